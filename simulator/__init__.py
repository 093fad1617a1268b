"""A provider simulator: OpenAI (chat completions, Responses) and Anthropic wire formats, usage, rate limits,
faults and pace."""

from simulator.app import make_app
from simulator.config import SimulatorConfig

__all__ = ["SimulatorConfig", "make_app"]
