"""Per-model token buckets that refill continuously, with one minute of burst, like provider limits.

Each (route, model) gets one bucket per configured dimension (e.g. requests, tokens). Admission is
all-or-nothing: a call is admitted only if every bucket holds its cost, and then all are charged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from plumbing.token_bucket import TokenBucket


@dataclass(frozen=True)
class BucketState:
    limit: int
    remaining: int
    reset_s: float  # seconds until the bucket is full again


@dataclass(frozen=True)
class Refusal:
    dimension: str
    retry_after_s: float
    limit: int


class Limits:
    """The buckets of one (route, model); dimensions with a limit of 0 are not limited."""

    def __init__(self, limits: dict[str, int], clock: Callable[[], float]) -> None:
        self._clock = clock
        # a minute of burst, like provider limits
        self._buckets = {dim: TokenBucket(limit / 60.0, limit, clock=clock) for dim, limit in limits.items() if limit > 0}

    def admit(self, costs: dict[str, float]) -> Refusal | None:
        now = self._clock()
        for dim, cost in costs.items():
            bucket = self._buckets.get(dim)
            if bucket is not None and (wait := bucket.wait_for(cost, now)) > 0:
                return Refusal(dim, wait, int(bucket.burst))
        for dim, cost in costs.items():
            if dim in self._buckets:
                self._buckets[dim].take(cost, now)
        return None

    def resize(self, limits: dict[str, int]) -> None:
        """New limits, as a provider changes an organisation's: each bucket keeps what it held, up to its new size."""
        now = self._clock()
        held = {dim: b.level(now) for dim, b in self._buckets.items()}
        self._buckets = {dim: TokenBucket(limit / 60.0, limit, clock=self._clock) for dim, limit in limits.items() if limit > 0}
        for dim, bucket in self._buckets.items():
            bucket.take(max(0.0, bucket.burst - held.get(dim, bucket.burst)), now)

    def snapshot(self) -> dict[str, BucketState]:
        now = self._clock()
        return {
            dim: BucketState(int(b.burst), max(0, math.floor(b.level(now))), b.until_full(now))
            for dim, b in self._buckets.items()
        }


class RateLimiter:
    """Creates each (route, model)'s Limits on first use, from the route's configured limits."""

    def __init__(
        self, limits_by_route: dict[str, dict[str, int]], clock: Callable[[], float] = time.monotonic
    ):
        self._config = limits_by_route
        self._clock = clock
        self._limits: dict[tuple[str, str], Limits] = {}

    def for_model(self, route: str, model: str) -> Limits:
        key = (route, model)
        if key not in self._limits:
            self._limits[key] = Limits(self._config[route], self._clock)
        return self._limits[key]

    def resize(self, limits_by_route: dict[str, dict[str, int]]) -> None:
        """Change every route's limits mid-run (the buckets made so far keep their levels, up to the new sizes)."""
        self._config = limits_by_route
        for (route, _), limits in self._limits.items():
            limits.resize(limits_by_route[route])

    def clear(self) -> None:
        self._limits.clear()


def go_duration(seconds: float) -> str:
    """Go's time.Duration.String() at millisecond precision, as in OpenAI's x-ratelimit-reset-*."""
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    text = f"{secs}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return text


def rfc3339_after(seconds: float) -> str:
    """The moment `seconds` from now, as Anthropic's anthropic-ratelimit-*-reset timestamps."""
    moment = datetime.now(UTC) + timedelta(seconds=math.ceil(seconds))
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
