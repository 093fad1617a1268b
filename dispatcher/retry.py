"""`retry`: which of a run's attempts to relaunch. An attempt qualifies when it is its slot's latest, no retry of it
is pending, and its status or its infrastructure class (report.infra_reason: lost_result, rate_limited, task_died,
...) is among those named; as many as the run's remaining budget covers at the per-attempt cap."""

from __future__ import annotations

import math

from dispatcher.report.outputs import infra_reason


def reason_of(attempt: dict) -> str:
    """The class an attempt ended in: its infrastructure class for an infra_error, else its status."""
    return infra_reason(attempt) if attempt["status"] == "INFRA_ERROR" else attempt["status"].lower()


def pick(current: list[dict], classes: set[str], remaining_usd: float,
         attempt_usd: float | None) -> tuple[list[tuple[str, int, int, str]], int]:
    """(instance_id, attempt, slot, reason) of each attempt to relaunch, and how many qualified but were left out
    for the budget. `current`: store.current_attempts."""
    chosen = [(a["instance_id"], a["attempt"], a["slot"], reason_of(a)) for a in current if not a["replaced"]
              and (a["status"].lower() in classes or reason_of(a) in classes)]
    room = len(chosen) if not attempt_usd else max(0, math.floor(remaining_usd / attempt_usd + 1e-9))
    if remaining_usd <= 0:
        room = 0
    return chosen[:room], max(0, len(chosen) - room)
