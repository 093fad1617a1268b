"""A token bucket for the cloud's API quotas (ECS RunTask, RegisterTaskDefinition): calls go at `rate` a second
with bursts of `burst`, queued in order rather than throttled and retried."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """Paces calls to `rate` tokens a second with bursts of `burst`. acquire() reserves its tokens and sleeps until
    they are due, so concurrent callers queue in order instead of spinning."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.rate, self.burst = rate, float(burst)
        self._clock, self._sleep = clock, sleep
        self._tokens, self._last = self.burst, clock()
        self._lock = threading.Lock()

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        return self._tokens

    def acquire(self, n: int = 1) -> float:
        """Take n tokens (one a task, for a launch quota); returns the seconds waited for them."""
        with self._lock:
            self._tokens = self._refill() - n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait:
            self._sleep(wait)
        return wait

    def available(self) -> int:
        """Whole tokens that can be taken now without waiting."""
        with self._lock:
            return max(0, int(self._refill()))
