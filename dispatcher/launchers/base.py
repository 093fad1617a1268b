"""The Launcher seam: start one isolated task per attempt, handing it only its job reference."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from contract.models import AttemptRef

AttemptEnv = Callable[[AttemptRef], dict[str, str]]  # the secrets one attempt's task gets (its attempt key)


def no_attempt_env(ref: AttemptRef) -> dict[str, str]:
    return {}


@dataclass
class TaskHandle:
    ref: AttemptRef
    task_id: str  # pid, container id or ECS task ARN


class Launcher(Protocol):
    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        """Start the task; it fetches its job from job_uri; its environment adds only the launcher's attempt_env(ref)
        (its attempt key). image: the attempt's task image by digest (its instance's image plus the runtime layer);
        None for the process launcher."""

    def poll(self, handle: TaskHandle) -> int | None:
        """None while running, else the exit code."""

    def stop(self, handle: TaskHandle) -> None:
        """Stop a task (cancel, or the wall-time guard)."""

    def find_running(self, run: str) -> list[TaskHandle]:
        """The run's tasks still alive, found again after a dispatcher restart ([] where not possible)."""

    def task_url(self, url: str) -> str:
        """How a task reaches an endpoint the dispatcher knows as `url` (write this into job documents)."""

    def launch_report(self) -> str:
        """The launcher's launch rate, as it measures (or is paced to) it, in a few words."""


class LaunchMeter:
    """A launcher's own launch rate: launches a second of time spent launching (what one driver thread can start),
    and over the wall time since the first launch (what it did start)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self.launches, self.busy_s = 0, 0.0
        self.first: float | None = None
        self._lock = threading.Lock()  # launchers that launch from several threads (ECS launch_many)

    @contextmanager
    def timed(self):
        """`with meter.timed(): launch one task` (counted only if it did not raise)."""
        t0 = self._clock()
        with self._lock:
            if self.first is None:
                self.first = t0
        yield
        with self._lock:
            self.launches += 1
            self.busy_s += self._clock() - t0

    @property
    def rate(self) -> float | None:
        return self.launches / self.busy_s if self.busy_s > 0 else None

    @property
    def wall_rate(self) -> float | None:
        if self.first is None or self.launches < 2:
            return None
        return self.launches / max(self._clock() - self.first, 1e-9)

    def report(self) -> str:
        rate, wall = self.rate, self.wall_rate
        if rate is None:
            return "no launches yet"
        return f"{self.launches} launched, {rate:.1f}/s while launching" + (f", {wall:.1f}/s overall" if wall else "")
