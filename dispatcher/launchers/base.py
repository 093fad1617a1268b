"""The Launcher seam: start one isolated task per attempt, handing it only its job reference.

A launcher is a `Launcher` subclass, registered by name in `dispatcher.launchers.LAUNCHERS` (or named by a dotted
path "package.module:Class" in `backend.launcher`), and built by its backend from a `LaunchContext` (`create`).
The driver loop calls every method unconditionally: the optional ones have serial / no-op defaults here.
"""

from __future__ import annotations

import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from contract.models import AttemptRef

if TYPE_CHECKING:
    from dispatcher.backends.base import Backend
    from dispatcher.plan import Plan

AttemptEnv = Callable[[AttemptRef], dict[str, str]]  # the secrets one attempt's task gets (its attempt key)


def no_attempt_env(ref: AttemptRef) -> dict[str, str]:
    return {}


@dataclass
class TaskHandle:
    ref: AttemptRef
    task_id: str  # pid, container id or ECS task ARN
    capacity: str | None = None  # on_demand or spot, once placed, where the launcher's platform prices them apart


@dataclass
class LaunchContext:
    """Everything a backend hands a launcher to build itself from (`Launcher.create`)."""

    plan: Plan
    backend: Backend  # the run's backend (the ECS launcher reads its stack outputs)
    run_dir: Path  # the run's folder on the dispatcher's host (task logs go under run_dir / "tasks")
    state_dir: Path  # the dispatcher's state folder
    upstream_url: str  # the provider gateway or the simulator, as the dispatcher reaches it
    upstream_key: str  # the run's provider key ("" where tasks get it elsewhere: ECS task definitions)
    valkey_url: str  # without credentials: tasks get the run's Valkey user (valkey_user) in their environment
    valkey_user: dict[str, str]  # the run's Valkey user's environment ({} where tasks get it elsewhere)
    aws_env: dict[str, str]  # the AWS endpoints and region the dispatcher uses
    attempt_env: AttemptEnv = no_attempt_env  # what one attempt's task gets besides (its attempt key)
    extra: dict[str, Any] = field(default_factory=dict)  # what a custom backend hands its custom launchers


class Launcher(ABC):
    """How tasks start, end and are found again. Subclasses declare what they need of the run:

    - `backend`: the backend they run under (a BACKENDS name or dotted path; a subclass of it qualifies);
    - `task_images`: whether each attempt runs in its task image (dispatcher.images), rather than on a local
      checkout of its repository's bundle;
    - `paced`: whether it paces launches to backend.launch_rate_per_s and backend.launch_burst (ECS's quota);
    - `problem(spec)`: why this spec's tasks cannot run here (None when they can), before anything starts."""

    backend: ClassVar[str] = "local"
    task_images: ClassVar[bool] = False
    paced: ClassVar[bool] = False  # launches are paced to a quota (backend.launch_rate_per_s, launch_burst)

    @classmethod
    def create(cls, ctx: LaunchContext) -> Launcher:
        """The launcher for a run, from what its backend hands it."""
        raise NotImplementedError(f"{cls.__module__}.{cls.__qualname__} does not define create(LaunchContext)")

    @classmethod
    def problem(cls, spec) -> str | None:
        return None

    @abstractmethod
    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        """Start the task; it fetches its job from job_uri; its environment adds only the launcher's attempt_env(ref)
        (its attempt key). image: the attempt's task image by digest (its instance's image plus the runtime layer);
        None where tasks do not run in task images."""

    @abstractmethod
    def poll(self, handle: TaskHandle) -> int | None:
        """None while running, else the exit code."""

    @abstractmethod
    def stop(self, handle: TaskHandle) -> None:
        """Stop a task (cancel, or the wall-time guard)."""

    def exit_reason(self, handle: TaskHandle) -> str | None:
        """Once poll() has seen the task end: the infrastructure failure class that ended it, where the launcher knows
        one (contract.models.OOM_KILLED: killed for memory; SPOT_INTERRUPTED: its Spot capacity taken back), else
        None."""
        return None

    def find_running(self, run: str) -> list[TaskHandle]:
        """The run's tasks still alive, found again after a dispatcher restart ([] where not possible)."""
        return []

    def task_url(self, url: str) -> str:
        """How a task reaches an endpoint the dispatcher knows as `url` (write this into job documents)."""
        return url

    def launch_many(self, items: list[tuple[AttemptRef, str, str | None]]) -> list[TaskHandle]:
        """launch() for each (attempt, job URI, task image); one after the other unless a launcher does better."""
        return [self.launch(*it) for it in items]

    def launch_room(self) -> int:
        """Tasks that may start now without waiting for a launch quota (no quota: no bound)."""
        return sys.maxsize

    def retry_pending(self) -> int:
        """Start what could not be placed before and is due (a launcher that places everything at once: nothing).
        Returns tasks placed."""
        return 0

    def launch_report(self) -> str | None:
        """The launcher's launch rate, as it measures (or is paced to) it, in a few words (None: not measured)."""
        return None


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
