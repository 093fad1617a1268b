"""Cost of a call from LiteLLM's bundled price table, read as JSON (importing litellm costs ~4 s and ~200 MB).

The formula (per token, Anthropic field names; OpenAI's cached tokens map to cache reads):
    cost = input * input_cost_per_token + cached * cache_read_input_token_cost
         + cache_write_5m * cache_creation_input_token_cost
         + cache_write_1h * cache_creation_input_token_cost_above_1hr
         + output * output_cost_per_token

with LiteLLM's rules for what the table leaves out or tiers:
  - a missing cache-read or cache-write rate is the input rate; a missing 1-hour write rate is the (5-minute)
    cache-write rate;
  - tiers: when the prompt (input + cached + cache writes) is above N tokens and the table has
    `<rate>_above_<N>_tokens` keys (e.g. input_cost_per_token_above_200k_tokens, and
    cache_creation_input_token_cost_above_1hr_above_200k_tokens), the highest crossed tier's rates apply to
    every token of the call; a rate the tier does not list keeps its lower-tier value. Service-tier variants
    (_priority, _flex, _batches, ...) are not standard pricing and are ignored.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # any object with these attributes will do
    from contract.models import Usage

PRICE_FILE_ENV = "EVALPLANE_PRICE_FILE"
_BUNDLED = "model_prices_and_context_window_backup.json"

# rate name in the table -> Rates field
_RATES = {
    "input_cost_per_token": "input",
    "output_cost_per_token": "output",
    "cache_read_input_token_cost": "cache_read",
    "cache_creation_input_token_cost": "cache_write",
    "cache_creation_input_token_cost_above_1hr": "cache_write_1h",
}


class UnknownModel(KeyError):
    pass


@dataclass(frozen=True, slots=True)
class Rates:
    """Per-token rates (USD) that apply to one call."""

    input: float
    output: float
    cache_read: float
    cache_write: float  # 5-minute cache writes (Anthropic's default TTL)
    cache_write_1h: float


@dataclass(frozen=True, slots=True)
class Price:
    input: float
    output: float
    cache_read: float
    cache_write: float
    max_output_tokens: int | None = None
    cache_write_1h: float | None = None  # None: same as cache_write
    tiers: tuple[tuple[int, Rates], ...] = ()  # (threshold N, rates above N prompt tokens), ascending N
    base: Rates | None = field(default=None, compare=False, repr=False)  # derived: the rates below every tier

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", Rates(self.input, self.output, self.cache_read, self.cache_write,
                                               self.cache_write if self.cache_write_1h is None
                                               else self.cache_write_1h))

    def rates(self, prompt_tokens: int = 0) -> Rates:
        """The rates for a call whose prompt (input + cached + cache writes) has this many tokens."""
        chosen = self.base
        for threshold, rates in self.tiers:
            if prompt_tokens > threshold:
                chosen = rates
        return chosen

    def cost(self, usage: Usage, cache_write_1h_tokens: int | None = None) -> float:
        """USD for one call's usage. The 1-hour share of cache_write_tokens comes from the argument, else from
        usage.cache_write_1h_tokens if the object has it, else 0 (all writes priced as 5-minute writes)."""
        w1h = cache_write_1h_tokens if cache_write_1h_tokens is not None else getattr(usage, "cache_write_1h_tokens", 0)
        w1h = min(max(w1h or 0, 0), usage.cache_write_tokens)
        r = self.rates(usage.input_tokens + usage.cached_tokens + usage.cache_write_tokens)
        return (
            usage.input_tokens * r.input
            + usage.cached_tokens * r.cache_read
            + (usage.cache_write_tokens - w1h) * r.cache_write
            + w1h * r.cache_write_1h
            + usage.output_tokens * r.output
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


def _threshold(text: str) -> int | None:
    """'200k' -> 200000, '128000' -> 128000; None if not a token count."""
    mult = 1000 if text.endswith("k") else 1
    try:
        return int(float(text.removesuffix("k")) * mult)
    except ValueError:
        return None


def from_entry(entry: dict[str, Any]) -> Price:
    """A Price from one entry of LiteLLM's table."""
    inp = float(entry["input_cost_per_token"])
    cache_read = float(entry.get("cache_read_input_token_cost", inp))
    cache_write = float(entry.get("cache_creation_input_token_cost", inp))
    w1h = entry.get("cache_creation_input_token_cost_above_1hr")
    base = {"input": inp, "output": float(entry.get("output_cost_per_token", 0.0)), "cache_read": cache_read,
            "cache_write": cache_write, "cache_write_1h": cache_write if w1h is None else float(w1h)}
    # tiers: <rate>_above_<N>_tokens, exactly (service-tier suffixes after _tokens are not standard pricing)
    found: dict[int, dict[str, float]] = {}
    for key, value in entry.items():
        if "_above_" not in key or not key.endswith("_tokens") or value is None:
            continue
        rate, _, rest = key.rpartition("_above_")
        n = _threshold(rest.removesuffix("_tokens"))
        if rate in _RATES and n is not None:
            try:
                found.setdefault(n, {})[_RATES[rate]] = float(value)
            except (TypeError, ValueError):
                continue
    tiers = []
    current = dict(base)
    for n in sorted(found):
        t = found[n]
        # a tier that prices input but not the caches: LiteLLM keeps the lower rates for the missing ones
        current = {**current, **t}
        # rates the entry does not have at all follow the tier's input rate (and the 1h write its 5m write)
        if "cache_read_input_token_cost" not in entry and "cache_read" not in t:
            current["cache_read"] = current["input"]
        if "cache_creation_input_token_cost" not in entry and "cache_write" not in t:
            current["cache_write"] = current["input"]
        if w1h is None and "cache_write_1h" not in t:
            current["cache_write_1h"] = current["cache_write"]
        tiers.append((n, Rates(**current)))
    return Price(
        input=base["input"], output=base["output"], cache_read=cache_read, cache_write=cache_write,
        max_output_tokens=entry.get("max_output_tokens"), cache_write_1h=base["cache_write_1h"], tiers=tuple(tiers),
    )


def _candidates(model: str, provider: str | None) -> list[str]:
    candidates = [model]
    if "/" in model:
        candidates.append(model.split("/", 1)[1])
    if provider:
        candidates.append(f"{provider}/{model}")
    return candidates


def price_one(model: str, provider: str | None = None, path: Path | None = None) -> Price:
    """price() without keeping the table: the entry is decoded straight from the file's text, so a process that
    needs one model's price (the shim, in every task) does not hold the whole parsed table (~4 MB)."""
    file = path or price_file()
    text = Path(file).read_text()
    decoder = json.JSONDecoder()
    for name in _candidates(model, provider):
        key = json.dumps(name) + ":"
        i = text.find(key)
        while i >= 0:
            j = i + len(key)
            while text[j] in " \t\r\n":
                j += 1
            if text[j] == "{":
                entry, _ = decoder.raw_decode(text, j)
                if isinstance(entry, dict) and "input_cost_per_token" in entry:
                    return from_entry(entry)
                break
            i = text.find(key, i + 1)  # the same text as a value, not a key: look further
    return price(model, provider, path)  # not found that way: the whole table decides (and raises)


def price(model: str, provider: str | None = None, path: Path | None = None) -> Price:
    """Price of a model id as the provider names it (with or without a 'provider/' prefix)."""
    table = _table(str(path or price_file()))
    for name in _candidates(model, provider):
        entry = table.get(name)
        if entry and "input_cost_per_token" in entry:
            return from_entry(entry)
    raise UnknownModel(f"no price for model {model!r} in {path or price_file()}")
