"""The run's progress in the terminal while it goes: attempts by status, spend against the run cap, ETA.

On stderr, so stdout stays the results. On a terminal it is a rich Live panel redrawn about once a second;
elsewhere (logs, CI, pipes) one line every few seconds. Spend is the run budget the shims keep in Valkey (through
the run's LiveRun, which also publishes the dashboard's keys).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from dispatcher.dashboard.live import LiveRun

STATUS_STYLE = {"RESOLVED": "green", "UNRESOLVED": "red", "EMPTY_PATCH": "yellow", "EVAL_ERROR": "magenta",
                "INFRA_ERROR": "bright_red", "CANCELLED": "dim", "PATCH_READY": "cyan"}


def eta_s(done: int, total: int, elapsed_s: float, done_at_start: int = 0) -> float | None:
    """Seconds left at the rate attempts finished since this driver started; None before one has."""
    finished_here = done - done_at_start
    if finished_here <= 0 or elapsed_s <= 0:
        return None
    return (total - done) * elapsed_s / finished_here


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


RESOLVED_FROM = {"copy": "their S3 result copy", "lost": "what their task left (lost_result or task_died)"}


class Progress:
    def __init__(self, console: Console | None, run: str, total: int, every_s: float = 5.0,
                 live: LiveRun | None = None, run_cap_usd: float | None = None):
        self.console = console or Console(stderr=True)
        self.run, self.total, self.every_s, self.live = run, total, every_s, live
        cap = run_cap_usd if run_cap_usd is not None else live.plan.spec.budget.run_usd if live else None
        self.cap = Decimal(str(cap)) if cap else None
        self._started = time.monotonic()
        self._last = 0.0
        self.launches: str | None = None
        self._done_at_start: int | None = None
        self._panel = Live(console=self.console, auto_refresh=False, transient=False) \
            if self.console.is_terminal else None

    def update(self, counts: Mapping[str, int], running: Mapping[Any, Any], launches: str | None = None) -> None:
        """counts: landed rows per status; running: the driver's tasks (values with .exit_code); launches: the
        launcher's own report of its launch rate."""
        self.launches = launches
        if self.live is not None:
            self.live.update(counts, running)
        now = time.monotonic()
        if now - self._last < (1.0 if self._panel else self.every_s):
            return
        self._last = now
        done = sum(n for s, n in counts.items() if s != "PATCH_READY")
        if self._done_at_start is None:
            self._done_at_start = done
        active = sum(1 for t in list(running.values()) if t.exit_code is None)
        spend = self.live.spend() if self.live is not None else None
        spent = spend[0] if spend else None
        eta = eta_s(done, self.total, now - self._started, self._done_at_start)
        if self._panel is None:
            self.console.print(self.line(counts, active, spent, eta), highlight=False, soft_wrap=True)
            return
        if not self._panel.is_started:
            self._panel.start()
        self._panel.update(self.panel(counts, active, spent, eta), refresh=True)

    def line(self, counts: Mapping[str, int], active: int, spent: Decimal | None, eta: float | None) -> str:
        parts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(counts.items()))
        money = "" if spent is None else f"; ${spent:.6f}" + (f" of ${self.cap}" if self.cap else "")
        return (f"{time.monotonic() - self._started:5.0f}s {self.run}: {sum(counts.values())}/{self.total} landed"
                f" ({parts or 'none yet'}); {active} task(s) running{money}; ETA {_duration(eta)}"
                + (f"; {self.launches}" if self.launches else ""))

    def panel(self, counts: Mapping[str, int], active: int, spent: Decimal | None, eta: float | None) -> Group:
        done = sum(n for s, n in counts.items() if s != "PATCH_READY")
        grid = Table.grid(padding=(0, 2))
        grid.add_row(Text(f"run {self.run}", style="bold"), ProgressBar(total=self.total, completed=done, width=40),
                     f"{done}/{self.total} final", f"ETA {_duration(eta)}")
        statuses = Text()
        for s, n in sorted(counts.items(), key=lambda kv: list(STATUS_STYLE).index(kv[0])
                           if kv[0] in STATUS_STYLE else 99):
            statuses.append(f"{s.lower()} {n}  ", style=STATUS_STYLE.get(s, ""))
        money = Text("spend unknown (no Valkey)") if spent is None else Text(f"spent ${spent:.6f}")
        if spent is not None and self.cap:
            share = float(spent / self.cap)
            money.append(f" of ${self.cap} cap ({share:.1%})", style="red" if share > 0.9 else "")
        tasks = Text(f"{active} task(s) running" + (f", {self.launches}" if self.launches else "") + ", ")
        return Group(grid, statuses or Text("nothing landed yet", style="dim"), tasks + money)

    def done(self, launches: str | None = None, resolved: dict[str, int] | None = None) -> None:
        """The run's last line, with its launch rate and the attempts the driver landed itself (their task gone)."""
        if self._panel is not None and self._panel.is_started:
            self._panel.stop()
        by_driver = ", ".join(f"{n} from {RESOLVED_FROM[k]}" for k, n in (resolved or {}).items() if n)
        tail = (f"; landed by the driver: {by_driver}" if by_driver else "") + (f"; {launches}" if launches else "")
        final = self.live.finish() if self.live is not None else None
        if final:
            self.console.print(f"{self.run}: all {self.total} attempts landed; ${Decimal(final['spent_usd']):.6f}"
                               f" over {final['calls']} call(s) (ledger){tail}", highlight=False)
            return
        self.console.print(f"[dim]{time.monotonic() - self._started:5.0f}s[/] {self.run}: all {self.total} attempts"
                           f" landed{tail}")
