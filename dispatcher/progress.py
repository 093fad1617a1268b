"""A one-line live progress display for a run (rich), printed to stderr so stdout stays the results."""

from __future__ import annotations

import time

from rich.console import Console

RESOLVED_FROM = {"copy": "their S3 result copy", "lost": "what their task left (lost_result or task_died)"}


class Progress:
    def __init__(self, console: Console | None, run: str, total: int, every_s: float = 5.0):
        self.console = console or Console(stderr=True)
        self.run, self.total, self.every_s = run, total, every_s
        self._last = 0.0
        self._started = time.monotonic()

    def update(self, counts: dict[str, int], running: dict, launches: str | None = None) -> None:
        """counts: landed rows per status; launches: the launcher's own report of its launch rate."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        active = sum(1 for t in running.values() if t.exit_code is None)
        parts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(counts.items()))
        self.console.print(
            f"[dim]{now - self._started:5.0f}s[/] {self.run}: {sum(counts.values())}/{self.total} landed"
            f" ({parts or 'none yet'}); {active} task(s) running" + (f"; {launches}" if launches else ""))

    def done(self, launches: str | None = None, resolved: dict[str, int] | None = None) -> None:
        """The run's last line, with its launch rate and the attempts the driver landed itself (their task gone)."""
        by_driver = ", ".join(f"{n} from {RESOLVED_FROM[k]}" for k, n in (resolved or {}).items() if n)
        self.console.print(
            f"[dim]{time.monotonic() - self._started:5.0f}s[/] {self.run}: all {self.total} attempts landed"
            + (f"; landed by the driver: {by_driver}" if by_driver else "") + (f"; {launches}" if launches else ""))
