"""Seeded dice for injected errors, so a run with --seed sees the same faults in the same order."""

from __future__ import annotations

import random
import time

from simulator.config import SimulatorConfig


class Faults:
    def __init__(self, config: SimulatorConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)
        # the outage window on time.monotonic(), apart from the dice: an outage takes no rolls, so the calls
        # after it see the same faults as in a run without it
        self.outage_status = config.outage_status
        self.outage_from = self.outage_until = 0.0
        if config.outage_at_s is not None and config.outage_s > 0:
            self.outage(config.outage_at_s, config.outage_s, config.outage_status)
        self._outage_after = config.outage_after_calls if config.outage_s > 0 else None
        self._calls = 0

    def outage(self, after_s: float, seconds: float, status: int) -> None:
        """From `after_s` seconds from now, for `seconds`, every call fails with `status` (0: dropped)."""
        self.outage_from = time.monotonic() + after_s
        self.outage_until = self.outage_from + seconds
        self.outage_status = status

    def in_outage(self) -> bool:
        """Asked once per request (which also counts it toward outage_after_calls)."""
        self._calls += 1
        if self._outage_after is not None and self._calls > self._outage_after:
            self._outage_after = None
            self.outage(0, self._config.outage_s, self._config.outage_status)
        return self.outage_from <= time.monotonic() < self.outage_until

    def outage_left_s(self) -> float:
        return max(self.outage_until - time.monotonic(), 0.0)

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    def status(self) -> int | None:
        """The error status to answer this request with, or None to serve it."""
        if self._roll(self._config.error_rate):
            return self._rng.choice(self._config.error_statuses)
        return None

    def stream_error(self) -> bool:
        return self._roll(self._config.stream_error_rate)

    def stream_cut(self) -> bool:
        return self._roll(self._config.stream_cut_rate)
