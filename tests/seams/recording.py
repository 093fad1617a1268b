"""Seams a user adds without touching the project, named by dotted path in a spec (tests/e2e/test_custom_seams.py).

RecordingLauncher: the process launcher, plus a line per launch in the run's folder (`LAUNCHES` under the run_dir
its LaunchContext gives), so a test can tell every attempt went through it.

RecordingGrader: the process grader, plus a line per grading in the same folder (`GRADINGS`), so a test can tell
every patch was graded by it (it runs in the eval workers, which the dispatcher starts from its own folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from contract.models import AttemptRef, EvalJob, Verdict
from dispatcher.launchers.base import LaunchContext, TaskHandle
from dispatcher.launchers.process import ProcessLauncher
from eval_worker.process_grader import ProcessGrader

LAUNCHES = "recorded-launches.jsonl"
GRADINGS = "recorded-gradings.jsonl"


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


class RecordingGrader(ProcessGrader):
    def grade(self, job: EvalJob, patch: str, logs_root: str | Path) -> Verdict:
        verdict = super().grade(job, patch, logs_root)
        record = Path(os.environ["EVALPLANE_STATE_DIR"]) / "runs" / job.ref.run / GRADINGS
        with record.open("a") as f:
            f.write(json.dumps({"instance_id": job.ref.instance_id, "attempt": job.ref.attempt,
                                "resolved": verdict.resolved}) + "\n")
        return verdict
