"""Deterministic token estimates (chars/4) and prompt caching across the turns of a conversation.

A prompt is a list of segments: a preamble (system prompt and tools) followed by one segment per
message. Hashing each prefix lets a later request that extends an earlier one find out how many of
its tokens the earlier request already put in the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


def estimate(value: Any) -> int:
    """chars/4, rounded up; strings count as themselves, anything else as its canonical JSON."""
    if not value:
        return 0
    text = value if isinstance(value, str) else _canonical(value)
    return math.ceil(len(text) / 4)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _digest(value: Any) -> str:
    return hashlib.blake2b(_canonical(value).encode(), digest_size=16).hexdigest()


def has_cache_marker(value: Any) -> bool:
    if isinstance(value, dict):
        return "cache_control" in value or any(has_cache_marker(v) for v in value.values())
    if isinstance(value, list):
        return any(has_cache_marker(v) for v in value)
    return False


@dataclass(frozen=True)
class Prompt:
    """A request's input as segments: what caching and billing need to know about it."""

    prefixes: tuple[str, ...]  # prefixes[i] identifies segments[: i + 1] (a hash chain)
    tokens: tuple[int, ...]
    marker: int | None  # index of the last segment carrying a cache_control marker

    @classmethod
    def of(cls, preamble: Any, messages: list[dict[str, Any]]) -> Prompt:
        segments = [preamble, *messages]
        prefixes, chain = [], ""
        for segment in segments:
            chain = _digest([chain, segment])
            prefixes.append(chain)
        marked = [i for i, segment in enumerate(segments) if has_cache_marker(segment)]
        return cls(
            prefixes=tuple(prefixes),
            tokens=tuple(estimate(s) for s in segments),
            marker=marked[-1] if marked else None,
        )

    @property
    def total(self) -> int:
        return sum(self.tokens)

    def tokens_through_marker(self) -> int:
        return 0 if self.marker is None else sum(self.tokens[: self.marker + 1])


class PromptCache:
    """The prompts seen lately (LRU); a request extending one of them reads that prompt from cache.

    Keyed by whole prompts rather than by conversation, so concurrent attempts at the same task, or
    a retried turn, do not evict each other's prefixes.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()

    def cached_tokens(self, scope: str, prompt: Prompt) -> int:
        """Tokens of the longest earlier prompt that this prompt extends (or repeats)."""
        for prefix in reversed(prompt.prefixes):
            if (key := (scope, prefix)) in self._seen:
                self._seen.move_to_end(key)
                return self._seen[key]
        return 0

    def remember(self, scope: str, prompt: Prompt) -> None:
        key = (scope, prompt.prefixes[-1])
        self._seen[key] = prompt.total
        self._seen.move_to_end(key)
        while len(self._seen) > self._size:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()


@dataclass(frozen=True)
class Billing:
    """What one call is billed, normalised like contract.models.Usage: input_tokens are uncached."""

    input_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    output_tokens: int

    @classmethod
    def of(cls, prompt: Prompt, cached: int, output_tokens: int, *, writes_cache: bool) -> Billing:
        write = max(0, prompt.tokens_through_marker() - cached) if writes_cache else 0
        return cls(prompt.total - cached - write, cached, write, output_tokens)

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cached_tokens + self.cache_write_tokens

    def with_output(self, output_tokens: int) -> Billing:
        return Billing(self.input_tokens, self.cached_tokens, self.cache_write_tokens, output_tokens)
