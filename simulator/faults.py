"""Seeded dice for injected errors, so a run with --seed sees the same faults in the same order."""

from __future__ import annotations

import random

from simulator.config import SimulatorConfig


class Faults:
    def __init__(self, config: SimulatorConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)

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
