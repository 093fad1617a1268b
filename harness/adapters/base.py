"""The harness seam: an adapter turns (job, checkout, shim endpoint) into a process to run, and reads its exit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from contract.models import HarnessOutcome, Job


@dataclass
class HarnessRun:
    argv: list[str]
    env: dict[str, str]  # the COMPLETE environment of the harness process: no secrets in it
    trajectory: Path


class HarnessAdapter(Protocol):
    name: str

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        """env: the instance's own environment (its conda env active, no secrets), for the agent's commands; the
        adapter adds its harness's settings to it."""

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        """How the harness says it ended (the shim's stop reason and the wall-time guard take precedence)."""
