"""Harness adapters: how each harness is started against the shim. One module per harness."""

from harness.adapters.base import HarnessAdapter, HarnessRun
from harness.adapters.mini_swe_agent import MiniSweAgent

ADAPTERS: dict[str, type[HarnessAdapter]] = {"mini-swe-agent": MiniSweAgent}

__all__ = ["ADAPTERS", "HarnessAdapter", "HarnessRun"]
