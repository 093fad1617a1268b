"""Seams a user adds without touching the project, named by dotted path in a spec (tests/e2e/test_custom_seams.py).

RecordingLauncher: the process launcher, plus a line per launch in the run's folder (`LAUNCHES` under the run_dir
its LaunchContext gives), so a test can tell every attempt went through it.

TODO(grader): a RecordingGrader, a subclass of the grading backend base eval_worker/graders.py is getting (issue 33),
named by dotted path in eval.backend, recording each grading beside the launches; added once that base is merged.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.models import AttemptRef
from dispatcher.launchers.base import LaunchContext, TaskHandle
from dispatcher.launchers.process import ProcessLauncher

LAUNCHES = "recorded-launches.jsonl"


class RecordingLauncher(ProcessLauncher):
    record: Path

    @classmethod
    def create(cls, ctx: LaunchContext) -> RecordingLauncher:
        launcher = super().create(ctx)
        launcher.record = ctx.run_dir / LAUNCHES
        return launcher

    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        handle = super().launch(ref, job_uri, image)
        with self.record.open("a") as f:
            f.write(json.dumps({"instance_id": ref.instance_id, "attempt": ref.attempt, "job_uri": job_uri,
                                "task_id": handle.task_id}) + "\n")
        return handle
