"""A run's call hold (`pause --hold-calls`): while contract.keys.run_hold(run) exists, the run's shims hold each new
model call (a call already upstream finishes) until it is gone. The runs row is the hold's durable state; the key
is how it reaches the shims, written by the control commands with that row locked (dispatcher.store.set_paused) and
read here. The held call waits in the shim's one hold loop (shim/server.py `_hold`), as it does for the pool's open
outage breaker: its held_ms and the attempt's wall time are counted the same way.
"""

from __future__ import annotations

import time

from contract import keys


class RunHold:
    """One run's hold, for a shim (redis.asyncio), as the hold loop reads a gate: `open_for_s` (None: not held) and
    `probe` (never: no call goes through a hold). Read from Valkey at most every poll_s unless `fresh`."""

    def __init__(self, redis, run: str, poll_s: float = 1.0):
        self.redis = redis
        self.key = keys.run_hold(run)
        self.poll_s = poll_s
        self._since: float | None = None  # when the hold was set (epoch seconds), as last read; None: not held
        self._read_at = float("-inf")

    async def open_for_s(self, fresh: bool = False) -> float | None:
        """How long the run's calls have been held (s), None if they are not."""
        if fresh or time.monotonic() - self._read_at >= self.poll_s:
            value = await self.redis.get(self.key)
            self._read_at = time.monotonic()
            self._since = None if value is None else _epoch(value)
        return None if self._since is None else max(0.0, time.time() - self._since)

    async def probe(self) -> bool:
        return False


def set_hold(valkey, run: str, on: bool) -> None:
    """Hold a run's calls, or lift the hold, with a synchronous client that may write the key (the admin's)."""
    if on:
        valkey.set(keys.run_hold(run), f"{time.time():.3f}", nx=True)  # a second pause keeps when it began
    else:
        valkey.delete(keys.run_hold(run))


def _epoch(value: bytes | str) -> float:
    try:
        return float(value)
    except ValueError:  # held all the same: only the admin writes it
        return time.time()
