"""A one-line live progress display for a run (rich), printed to stderr so stdout stays the results."""

from __future__ import annotations

import time

from rich.console import Console


class Progress:
    def __init__(self, console: Console | None, run: str, total: int, every_s: float = 5.0):
        self.console = console or Console(stderr=True)
        self.run, self.total, self.every_s = run, total, every_s
        self._last = 0.0
        self._started = time.monotonic()

    def update(self, counts: dict[str, int], running: dict) -> None:
        """counts: landed rows per status."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        active = sum(1 for t in running.values() if t.exit_code is None)
        parts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(counts.items()))
        self.console.print(
            f"[dim]{now - self._started:5.0f}s[/] {self.run}: {sum(counts.values())}/{self.total} landed"
            f" ({parts or 'none yet'}); {active} task(s) running"
        )

    def done(self) -> None:
        self.console.print(f"[dim]{time.monotonic() - self._started:5.0f}s[/] {self.run}: all {self.total} attempts landed")
