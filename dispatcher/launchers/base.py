"""The Launcher seam: start one isolated task per attempt, handing it only its job reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from contract.models import AttemptRef


@dataclass
class TaskHandle:
    ref: AttemptRef
    task_id: str  # pid, container id or ECS task ARN


class Launcher(Protocol):
    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        """Start the task; it fetches its job from job_uri and nothing else is passed. image: the attempt's task
        image by digest (its instance's image plus the runtime layer); None for the process launcher."""

    def poll(self, handle: TaskHandle) -> int | None:
        """None while running, else the exit code."""

    def stop(self, handle: TaskHandle) -> None:
        """Stop a task (cancel, or the wall-time guard)."""

    def find_running(self, run: str) -> list[TaskHandle]:
        """The run's tasks still alive, found again after a dispatcher restart ([] where not possible)."""

    def task_url(self, url: str) -> str:
        """How a task reaches an endpoint the dispatcher knows as `url` (write this into job documents)."""
