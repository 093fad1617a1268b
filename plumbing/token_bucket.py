"""The project's token bucket: `rate` tokens a second, at most `burst` held. Two uses: the cloud's API quotas (ECS
RunTask, RegisterTaskDefinition), where acquire() queues calls in order rather than having them throttled and
retried; and the provider simulator's rate limits (simulator/ratelimit.py), which ask what a call would wait
(wait_for), charge it (take) and report the bucket's level, all at one instant `now` for every bucket of a call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """Paces calls to `rate` tokens a second with bursts of `burst`. acquire() reserves its tokens and sleeps until
    they are due, so concurrent callers queue in order instead of spinning. The level may go below zero: tokens
    reserved ahead of their time."""

    def __init__(self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.rate, self.burst = rate, float(burst)
        self._clock, self._sleep = clock, sleep
        self._tokens, self._last = self.burst, clock()
        self._lock = threading.Lock()

    def _refill(self, now: float | None) -> float:
        now = self._clock() if now is None else now
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        return self._tokens

    def acquire(self, n: float = 1) -> float:
        """Take n tokens (one a task, for a launch quota); returns the seconds waited for them."""
        with self._lock:
            self._tokens = self._refill(None) - n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait:
            self._sleep(wait)
        return wait

    def available(self) -> int:
        """Whole tokens that can be taken now without waiting."""
        with self._lock:
            return max(0, int(self._refill(None)))

    def level(self, now: float | None = None) -> float:
        """Tokens held at `now` (the clock's time by default)."""
        with self._lock:
            return self._refill(now)

    def wait_for(self, cost: float, now: float | None = None) -> float:
        """Seconds until the bucket holds `cost` (0 if it does now); takes nothing."""
        return max(0.0, (cost - self.level(now)) / self.rate)

    def take(self, cost: float, now: float | None = None) -> None:
        """Charge `cost` without waiting (the caller checked wait_for)."""
        with self._lock:
            self._tokens = self._refill(now) - cost

    def until_full(self, now: float | None = None) -> float:
        """Seconds until the bucket holds its burst again."""
        return (self.burst - self.level(now)) / self.rate
