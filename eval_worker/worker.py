"""The SQS eval worker: EvalJob in, Verdict out.

For each message (long polling): parse the EvalJob, keep extending the message's visibility while
grading, fetch the patch from job.patch_uri (S3), grade it, upload the instance's log files under
job.artifacts_prefix + "eval/", send Envelope(msg=verdict) to job.verdict_queue_url, signed with the verdict key
(contract.signing: the writer lands no verdict without it), and only then delete the eval message.
Every verdict carries the patch's tamper flags (eval_worker.tamper); the files of the rules that decide which code
pytest runs first (conftest.py, pytest config, plugin registrations) are left out of the graded patch, and the
verdict's reason names them. A crash anywhere before the delete leaves the message to reappear; grading is
idempotent and the results writer upserts on (run, instance_id, attempt).

Poison messages (not an EvalJob, or an empty patch, which the writer never enqueues) are logged and
deleted without a verdict. A patch that cannot be fetched gives an INFRA_ERROR verdict.
"""

from __future__ import annotations

import logging
import resource
import shutil
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from contract import aws, signing
from contract.models import Envelope, EvalJob, EvalOutcome, Verdict, utcnow
from eval_worker.graders import Grader, resolve_grader
from eval_worker.grading import grade
from eval_worker.layout import UPLOADED_FILES, instance_log_dir
from eval_worker.tamper import graded_patch, tamper_flags

log = logging.getLogger("eval_worker")

CONTENT_TYPES = {".json": "application/json", ".diff": "text/x-diff", ".sh": "text/x-shellscript"}
MAX_WAIT_S = 20  # SQS long-polling maximum
# the official report entry of a patch with nothing left to apply once grading's left-out files are cut
NOTHING_GRADED = {"patch_is_None": False, "patch_exists": True, "patch_successfully_applied": False,
                  "resolved": False}


eval_prefix = aws.eval_logs_prefix


def cpu_seconds() -> float:
    """CPU time of this thread and of the child processes reaped so far (a grading's, for ProcessGrader)."""
    own, kids = resource.getrusage(resource.RUSAGE_THREAD), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class _VisibilityKeeper:
    """Extends a message's visibility timeout every third of it, until stopped."""

    def __init__(self, sqs, queue_url: str, receipt: str, timeout_s: int):
        self.sqs, self.queue_url, self.receipt, self.timeout_s = sqs, queue_url, receipt, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="visibility-keeper", daemon=True)
        self.extensions = 0

    def _run(self) -> None:
        period = max(self.timeout_s / 3.0, 0.2)
        while not self._stop.wait(period):
            try:
                self.sqs.change_message_visibility(
                    QueueUrl=self.queue_url, ReceiptHandle=self.receipt, VisibilityTimeout=self.timeout_s
                )
                self.extensions += 1
            except Exception as e:  # noqa: BLE001 - keep trying; the worst case is a duplicate (idempotent) grading
                log.warning("could not extend visibility: %s", e)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class EvalWorker:
    def __init__(
        self,
        queue_url: str,
        logs_root: str | Path = ".",
        grader: str | Grader | None = None,
        visibility_timeout: int = 120,
        wait_time_s: int = MAX_WAIT_S,
        verdict_key: bytes | None = None,
    ):
        """grader: a Grader, or its name in eval_worker.graders.GRADERS (default process); verdict_key: what
        verdicts are signed with (default: $EVALPLANE_VERDICT_KEY, hex); required."""
        self.verdict_key = verdict_key or signing.key_from_env(signing.VERDICT_KEY_ENV)
        if not self.verdict_key:
            raise ValueError(f"{signing.VERDICT_KEY_ENV} is not set: the writer lands no unsigned verdict")
        self.queue_url = queue_url
        self.logs_root = Path(logs_root)
        self.grader = resolve_grader(grader)
        self.visibility_timeout = int(visibility_timeout)
        self.wait_time_s = wait_time_s
        self.processed = 0

    @property
    def sqs(self):
        return aws.client("sqs")

    # ------------------------------------------------------------------ loop

    def run(self, once: bool = False, idle_exit: float | None = None) -> int:
        """Consume until stopped. once: handle at most one message (one long poll if none comes).
        idle_exit: return after that many seconds without a message. Returns messages handled."""
        idle_since = time.monotonic()
        while True:
            wait = self.wait_time_s
            if idle_exit is not None:
                remaining = idle_exit - (time.monotonic() - idle_since)
                if remaining <= 0:
                    log.info("idle for %.0f s, exiting", idle_exit)
                    return self.processed
                wait = max(0, min(wait, int(remaining + 0.999)))
            resp = self.sqs.receive_message(
                QueueUrl=self.queue_url,
                MaxNumberOfMessages=1,
                WaitTimeSeconds=wait,
                VisibilityTimeout=self.visibility_timeout,
            )
            msgs = resp.get("Messages", [])
            for m in msgs:
                try:
                    self.handle(m)
                except Exception:  # not deleted: the message reappears after its visibility timeout
                    log.exception("failed to handle message %s; leaving it on the queue", m.get("MessageId"))
                idle_since = time.monotonic()
            if once:
                return self.processed

    # ------------------------------------------------------------------ one message

    def handle(self, message: dict) -> Verdict | None:
        receipt = message["ReceiptHandle"]
        try:
            job = EvalJob.model_validate_json(message["Body"])
        except ValidationError as e:
            log.error("poison message %s (not an EvalJob), deleting: %s", message.get("MessageId"), e)
            self._delete(receipt)
            return None
        with _VisibilityKeeper(self.sqs, self.queue_url, receipt, self.visibility_timeout):
            verdict = self.grade_job(job)
            if verdict is None:
                self._delete(receipt)
                return None
            if verdict.outcome is not EvalOutcome.INFRA_ERROR or self._log_dir(job).is_dir():
                verdict = self._upload(job, verdict)
            aws.send(job.verdict_queue_url, Envelope(msg=verdict).model_dump_json(),
                     sign=signing.signer(self.verdict_key))
        self._delete(receipt)
        self.processed += 1
        log.info("%s %s: %s", job.ref.run, job.ref.slug, verdict.outcome.value)
        return verdict

    def grade_job(self, job: EvalJob) -> Verdict | None:
        started = utcnow()
        try:
            patch = aws.get_text(job.patch_uri)
        except Exception as e:  # noqa: BLE001 - whatever the store raised, the attempt lands infra_error
            log.error("%s: could not fetch patch %s: %s", job.ref.slug, job.patch_uri, e)
            return Verdict(
                ref=job.ref, outcome=EvalOutcome.INFRA_ERROR, resolved=False,
                reason=f"patch fetch failed: {e}", started_at=started, ended_at=utcnow(),
            )
        shutil.rmtree(self._log_dir(job), ignore_errors=True)  # never upload a stale grading's files
        if not patch.strip():
            log.error("%s: empty patch on the eval queue (never graded), deleting", job.ref.slug)
            return None
        flags = tamper_flags(patch, job.instance)
        if flags:
            log.warning("%s: tamper flags %s", job.ref.slug, "; ".join(f"{f.rule}: {', '.join(f.files)}" for f in flags))
        graded, left_out = graded_patch(patch, flags)
        if not graded.strip():  # nothing but files grading leaves out: the untouched base, which fails FAIL_TO_PASS
            return Verdict(ref=job.ref, outcome=EvalOutcome.UNRESOLVED, resolved=False, report=NOTHING_GRADED,
                           reason=f"nothing graded: the patch changes only {', '.join(left_out)}", started_at=started,
                           ended_at=utcnow(), tamper_flags=flags)
        cpu = cpu_seconds()
        verdict = grade(job, graded, self.logs_root, self.grader)
        if self.grader.children_cpu:
            verdict = verdict.model_copy(update={"grading_cpu_s": round(cpu_seconds() - cpu, 6)})
        if left_out:
            verdict = verdict.model_copy(update={"reason": "; ".join(
                filter(None, [verdict.reason, f"graded without {', '.join(left_out)}"]))})
        return verdict.model_copy(update={"tamper_flags": flags})

    def _log_dir(self, job: EvalJob) -> Path:
        ref = job.ref
        return instance_log_dir(self.logs_root, ref.run, ref.attempt, job.model_name, ref.instance_id)

    def _upload(self, job: EvalJob, verdict: Verdict) -> Verdict:
        d = self._log_dir(job)
        prefix = eval_prefix(job.artifacts_prefix)
        report_uri = None
        for name in UPLOADED_FILES:
            f = d / name
            if not f.is_file():
                continue
            uri = prefix + name
            aws.put_text(uri, f.read_bytes(), CONTENT_TYPES.get(f.suffix, "text/plain"))
            if name == "report.json":
                report_uri = uri
        return verdict.model_copy(update={"report_uri": report_uri})

    def _delete(self, receipt: str) -> None:
        self.sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=receipt)
