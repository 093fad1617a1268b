"""kill -9 of a docker-backend worker mid-grade: the job is delivered again, the verdict lands once,
and the killed worker's container does not survive the second worker's grading."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ew_helpers import ROOT, patch_from_edits
from test_worker_sqs import _job, _queue_empty, _setup

from contract import aws
from contract.models import Envelope, EvalOutcome, Verdict
from eval_worker.docker_backend import container_name
from eval_worker.layout import official_run_id


def _worker(evalq: str, logs_root, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}  # grade on the local image id
    return subprocess.Popen(
        [sys.executable, "-m", "eval_worker", "--backend", "docker", "--queue", evalq, "--logs-root",
         str(logs_root), "--visibility-timeout", "4", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_sigkill_mid_grade_redelivers_and_verdict_lands_once(moto_endpoint, eval_images, docker_client,
                                                             instances, unique, tmp_path):
    _s3, sqs, bucket, evalq, resq = _setup(unique)
    row = instances["evalplane__calc-1"]
    slow_gold = patch_from_edits(row, [
        ("calc/stats.py", "def median(values):\n", "import time as _t\n_t.sleep(8)\n\n\ndef median(values):\n"),
        ("calc/stats.py", "    return ordered[mid]\n",
         "    if len(ordered) % 2:\n        return ordered[mid]\n    return (ordered[mid - 1] + ordered[mid]) / 2\n"),
    ], tmp_path)
    job = _job(row, bucket, unique, resq, slow_gold)
    aws.send(evalq, job.model_dump_json())
    name = container_name(row["instance_id"], official_run_id(unique, 1))

    first = _worker(evalq, tmp_path / "w1", "--wait-time", "5", "--once")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # mid-grade: the eval script is running in the container
        running = [c for c in docker_client.containers.list(filters={"name": name}) if c.name == name]
        if running and "/eval.sh" in " ".join(p[-1] for p in running[0].top()["Processes"]):
            break
        assert first.poll() is None, first.stdout.read()
        time.sleep(0.2)
    else:
        raise AssertionError("the first worker never started the eval script")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert [c.name for c in docker_client.containers.list(filters={"name": name})] == [name]  # orphaned

    second = _worker(evalq, tmp_path / "w2", "--wait-time", "20", "--once")
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    assert "removed stale container" in out

    msgs = sqs.receive_message(QueueUrl=resq, MaxNumberOfMessages=10, WaitTimeSeconds=2).get("Messages", [])
    verdicts = [Envelope.model_validate_json(m["Body"]).msg for m in msgs]
    assert len(verdicts) == 1 and isinstance(verdicts[0], Verdict) and verdicts[0].ref == job.ref
    assert verdicts[0].outcome is EvalOutcome.RESOLVED
    assert _queue_empty(sqs, evalq)  # the redelivered eval message was deleted
    assert docker_client.containers.list(all=True, filters={"name": name}) == []
