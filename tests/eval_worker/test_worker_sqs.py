"""The SQS worker path end to end on moto's server: EvalJob in, Verdict out, eval message deleted, logs in S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ew_helpers import ROOT, SYNTH, make_job
from test_grading import NON_APPLYING

from contract import aws, signing
from contract.models import Envelope, EvalOutcome, Verdict
from eval_worker.environments import RecipeBook
from eval_worker.layout import BASE_TEST_OUTPUT, LOG_FILES
from eval_worker.process_grader import ProcessGrader
from eval_worker.worker import EvalWorker


def _setup(unique: str):
    s3, sqs = aws.client("s3"), aws.client("sqs")
    bucket = f"ep-{unique}"
    s3.create_bucket(Bucket=bucket)
    evalq = sqs.create_queue(QueueName=f"{unique}-eval")["QueueUrl"]
    resq = sqs.create_queue(QueueName=f"{unique}-results")["QueueUrl"]
    return s3, sqs, bucket, evalq, resq


def _job(row, bucket, run, resq, patch: str, attempt: int = 1):
    iid = row["instance_id"]
    prefix = f"s3://{bucket}/runs/{run}/attempts/{iid}/{attempt}/"
    aws.put_text(prefix + "patch.diff", patch, "text/x-diff")
    return make_job(row, run=run, attempt=attempt, patch_uri=prefix + "patch.diff", verdict_queue_url=resq,
                    artifacts_prefix=prefix, timeout_s=120)


def _queue_empty(sqs, url) -> bool:
    a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    return a["ApproximateNumberOfMessages"] == "0" and a["ApproximateNumberOfMessagesNotVisible"] == "0"


def test_cli_worker_end_to_end(moto_endpoint, instances, unique, tmp_path, verdict_key):
    s3, sqs, bucket, evalq, resq = _setup(unique)
    row = instances["evalplane__textkit-1"]
    job = _job(row, bucket, unique, resq, row["patch"])
    aws.send(evalq, job.model_dump_json())

    r = subprocess.run(
        [sys.executable, "-m", "eval_worker", "--queue", evalq, "--logs-root", str(tmp_path / "logs-root"),
         "--once", "--wait-time", "5", "--visibility-timeout", "30"],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=180, check=False
    )
    assert r.returncode == 0, r.stderr

    msgs = sqs.receive_message(QueueUrl=resq, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                               MessageAttributeNames=[signing.SIG_ATTRIBUTE]).get("Messages", [])
    assert len(msgs) == 1
    sig = msgs[0]["MessageAttributes"][signing.SIG_ATTRIBUTE]["StringValue"]
    assert signing.verify(verdict_key, msgs[0]["Body"], sig)  # signed with the verdict key, over its body
    v = Envelope.model_validate_json(msgs[0]["Body"]).msg
    assert isinstance(v, Verdict) and v.ref == job.ref
    assert v.outcome is EvalOutcome.RESOLVED and v.resolved and v.tamper_flags == []
    assert v.report_uri == job.artifacts_prefix + "eval/report.json"
    assert json.loads(aws.get_text(v.report_uri))[row["instance_id"]] == v.report

    assert _queue_empty(sqs, evalq)  # the eval message was deleted
    keys = s3.list_objects_v2(Bucket=bucket, Prefix=f"runs/{unique}/attempts/{row['instance_id']}/1/eval/")
    assert sorted(k["Key"].rsplit("/", 1)[1] for k in keys["Contents"]) == sorted(LOG_FILES)
    # and the official layout on local disk
    d = tmp_path / "logs-root" / "logs" / "run_evaluation" / unique / "evalplane__demo-model" / row["instance_id"]
    assert (d / "report.json").exists()


class _PeekingGrader(ProcessGrader):
    """Sleeps past the visibility timeout, then checks the message being graded stays invisible."""

    def __init__(self, sqs, queue_url, **kw):
        super().__init__(**kw)
        self.sqs, self.queue_url, self.peeked = sqs, queue_url, None

    def create(self, **kw):
        time.sleep(2.5)
        self.peeked = self.sqs.receive_message(QueueUrl=self.queue_url, WaitTimeSeconds=0).get("Messages", [])
        return super().create(**kw)


def test_worker_keeps_message_invisible_and_drops_poison(moto_endpoint, instances, unique, tmp_path):
    _s3, sqs, bucket, evalq, resq = _setup(unique)
    row = instances["evalplane__textkit-3"]
    aws.send(evalq, '{"not": "an eval job"}')
    aws.send(evalq, _job(row, bucket, unique, resq, "", attempt=1).model_dump_json())  # empty: never graded
    job = _job(row, bucket, unique, resq, NON_APPLYING, attempt=2)
    aws.send(evalq, job.model_dump_json())

    backend = _PeekingGrader(sqs, evalq)
    worker = EvalWorker(evalq, tmp_path, grader=backend, visibility_timeout=1, wait_time_s=1)
    worker.run(idle_exit=2)

    assert worker.processed == 1
    assert backend.peeked == []  # visibility was extended while grading
    assert _queue_empty(sqs, evalq)
    msgs = sqs.receive_message(QueueUrl=resq, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])
    assert len(msgs) == 1
    v = Envelope.model_validate_json(msgs[0]["Body"]).msg
    assert v.ref == job.ref and v.outcome is EvalOutcome.APPLY_FAILED and v.report_uri is None
    log = aws.get_text(job.artifacts_prefix + "eval/run_instance.log")
    assert ">>>>> Patch Apply Failed" in log


def test_cli_worker_environment_that_cannot_run_tests(moto_endpoint, instances, unique, tmp_path):
    """--environments: a recipe without pytest for evalplane/calc 0.2. The gold patch lands as infra_error
    (environment_broken), with the base check's output uploaded beside the official files. A bad recipe file
    is refused before any message is taken."""
    from test_environments import synthetic_recipe

    s3, sqs, bucket, evalq, resq = _setup(unique)
    row = instances["evalplane__calc-2"]
    job = _job(row, bucket, unique, resq, row["patch"])
    aws.send(evalq, job.model_dump_json())
    worker = [sys.executable, "-m", "eval_worker", "--queue", evalq, "--logs-root", str(tmp_path / "logs-root"),
              "--once", "--wait-time", "5", "--visibility-timeout", "30"]
    env = {**os.environ, "EVALPLANE_STATE_DIR": str(tmp_path / "state")}

    bad = tmp_path / "bad.toml"
    bad.write_text(synthetic_recipe(packages=["pytest>=8"]))
    r = subprocess.run([*worker, "--environments", str(bad)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2 and f"--environments: {bad}: environment[0].packages" in r.stderr, r.stderr
    assert sqs.get_queue_attributes(QueueUrl=evalq, AttributeNames=["ApproximateNumberOfMessages"])[
        "Attributes"]["ApproximateNumberOfMessages"] == "1"

    broken = tmp_path / "broken.toml"
    good = RecipeBook.load(SYNTH / "repos" / "environments.toml").get("evalplane/calc", "0.2")
    broken.write_text(synthetic_recipe(packages=good.requirements(drop=["pytest"])))
    r = subprocess.run([*worker, "--environments", str(broken)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    msgs = sqs.receive_message(QueueUrl=resq, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])
    v = Envelope.model_validate_json(msgs[0]["Body"]).msg
    assert v.outcome is EvalOutcome.INFRA_ERROR and v.report["infra_failure_reason"] == "environment_broken", v
    assert json.loads(aws.get_text(v.report_uri))[row["instance_id"]] == v.report
    keys = s3.list_objects_v2(Bucket=bucket, Prefix=f"runs/{unique}/attempts/{row['instance_id']}/1/eval/")
    assert sorted(k["Key"].rsplit("/", 1)[1] for k in keys["Contents"]) == sorted((*LOG_FILES, BASE_TEST_OUTPUT))
    assert _queue_empty(sqs, evalq)
