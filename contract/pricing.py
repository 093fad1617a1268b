"""Cost of a call from LiteLLM's bundled price table, read as JSON (importing litellm costs ~4 s and ~200 MB).

The formula (per token, Anthropic field names; OpenAI's cached tokens map to cache reads):
    cost = input * input_cost_per_token + cached * cache_read_input_token_cost
         + cache_write * cache_creation_input_token_cost + output * output_cost_per_token
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from contract.models import Usage

PRICE_FILE_ENV = "EVALPLANE_PRICE_FILE"
_BUNDLED = "model_prices_and_context_window_backup.json"


class UnknownModel(KeyError):
    pass


@dataclass(frozen=True, slots=True)
class Price:
    input: float
    output: float
    cache_read: float
    cache_write: float
    max_output_tokens: int | None = None

    def cost(self, usage: Usage) -> float:
        return (
            usage.input_tokens * self.input
            + usage.cached_tokens * self.cache_read
            + usage.cache_write_tokens * self.cache_write
            + usage.output_tokens * self.output
        )


def price_file() -> Path:
    """The price table: $EVALPLANE_PRICE_FILE, else the copy bundled in the installed litellm package."""
    if os.environ.get(PRICE_FILE_ENV):
        return Path(os.environ[PRICE_FILE_ENV])
    spec = importlib.util.find_spec("litellm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("litellm is not installed and EVALPLANE_PRICE_FILE is not set")
    return Path(next(iter(spec.submodule_search_locations))) / _BUNDLED


@lru_cache(maxsize=4)
def _table(path: str) -> dict:
    return json.loads(Path(path).read_text())


def price(model: str, provider: str | None = None, path: Path | None = None) -> Price:
    """Price of a model id as the provider names it (with or without a 'provider/' prefix)."""
    table = _table(str(path or price_file()))
    candidates = [model]
    if "/" in model:
        candidates.append(model.split("/", 1)[1])
    if provider:
        candidates.append(f"{provider}/{model}")
    for name in candidates:
        entry = table.get(name)
        if entry and "input_cost_per_token" in entry:
            inp = float(entry["input_cost_per_token"])
            return Price(
                input=inp,
                output=float(entry.get("output_cost_per_token", 0.0)),
                cache_read=float(entry.get("cache_read_input_token_cost", inp)),
                cache_write=float(entry.get("cache_creation_input_token_cost", inp)),
                max_output_tokens=entry.get("max_output_tokens"),
            )
    raise UnknownModel(f"no price for model {model!r} in {path or price_file()}")
