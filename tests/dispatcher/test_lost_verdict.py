"""A run always ends, also for grading (issue 26): a patch whose verdict never comes lands as infra_error
(verdict_lost), never as the model's, and the official report counts it among the infrastructure failures.

A real run: `python -m dispatcher run` on the synthetic instances (process launcher, the provider simulator, an eval
worker grading with the process backend, the real PostgreSQL and Valkey). Its S3 and SQS are this session's moto
server, which runs in this process: there one verdict is dropped on its way (SQS answers the eval worker as if it
stored it, as moto's delete race did to bench__sim-616's result) and one eval job goes straight to the eval
dead-letter queue (what SQS does after resources.MAX_RECEIVES deliveries whose graders died).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from moto.sqs.models import SQSBackend

from contract import aws, signing
from contract.models import AttemptRef, AttemptResult, Envelope, EvalOutcome, HarnessOutcome, Verdict, utcnow
from dispatcher.backends import resources
from dispatcher.driver import loop as runmod
from dispatcher.driver.writer import ResultsWriter
from dispatcher.plan import make_plan
from dispatcher.spec import load_spec
from tests.e2e.test_local_run import without_gateway

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
VERDICT_WAIT_S = 10
LOST = "evalplane__calc-2"  # a gold patch: graded, its verdict dropped
DEAD = "evalplane__textkit-1"  # a gold patch: its eval job dead-lettered, never graded
GRADED = {"evalplane__calc-1": "UNRESOLVED", "evalplane__textkit-2": "EMPTY_PATCH", "evalplane__textkit-3": "RESOLVED"}


def spec_file(tmp_path: Path, run: str, verdict_wait_s: float = VERDICT_WAIT_S) -> Path:
    text = without_gateway((ROOT / "examples" / "local.toml").read_text())
    text = text.replace('name = "local-demo"', f'name = "{run}"').replace('"synthetic/', f'"{SYNTHETIC}/')
    text = text.replace("timeout_s = 120", f"timeout_s = 120\nverdict_wait_s = {verdict_wait_s}")
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    return spec


@pytest.fixture
def faults(monkeypatch, moto_endpoint, unique):
    """moto's SendMessage in this process, with the two faults: what it did is recorded."""
    sink = aws.client("sqs").create_queue(QueueName=f"{unique}-sink")["QueueUrl"]  # a queue nobody reads
    eval_queue, eval_dlq = (resources._queue_name(unique, role) for role in ("eval", "eval-dlq"))
    stock = SQSBackend.send_message
    done: dict[str, str] = {}
    lock = threading.Lock()

    def send_message(self, queue_name, message_body, *args, **kwargs):
        fault = None
        if '"kind":"verdict"' in message_body and f'"instance_id":"{LOST}"' in message_body:
            fault, queue_name = "verdict dropped", sink.rsplit("/", 1)[1]
        elif queue_name == eval_queue and f'"instance_id":"{DEAD}"' in message_body:
            fault, queue_name = "eval job dead-lettered", eval_dlq
        if fault:
            with lock:
                done[fault] = message_body
        return stock(self, queue_name, message_body, *args, **kwargs)

    monkeypatch.setattr(SQSBackend, "send_message", send_message)
    yield done
    aws.client("sqs").delete_queue(QueueUrl=sink)


@pytest.mark.e2e
def test_a_lost_verdict_and_a_dead_lettered_eval_job_end_as_infra_errors_and_the_run_ends(
        tmp_path, database_url, valkey_url, moto_endpoint, unique, faults):
    env = {**os.environ, "DATABASE_URL": database_url, "VALKEY_URL": valkey_url,
           "AWS_ENDPOINT_URL": moto_endpoint, "EVALPLANE_STATE_DIR": str(tmp_path / "state"),
           "RAY_USAGE_STATS_ENABLED": "0",
           # Ray's node waits 30 s for its agent to start, which a loaded two-core machine can miss
           "RAY_agent_register_timeout_ms": "120000"}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "dispatcher", "run", str(spec_file(tmp_path, unique)), "--out", str(out)],
                       check=False, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]  # the run ended
    assert set(faults) == {"verdict dropped", "eval job dead-lettered"}  # both faults happened
    assert json.loads(faults["verdict dropped"])["msg"]["outcome"] == "resolved"  # graded, then lost

    with psycopg.connect(database_url) as conn:
        rows = {r[0]: r[1:] for r in conn.execute(
            "SELECT instance_id, status, eval_outcome, resolved, report->>'infra_failure_reason' FROM attempts"
            " WHERE run = %s", (unique,))}
        phases = dict(conn.execute("SELECT instance_id, detail->>'reason' FROM phases WHERE run = %s AND phase = 'eval'",
                                   (unique,)).fetchall())
        run_status = conn.execute("SELECT status FROM runs WHERE run = %s", (unique,)).fetchone()[0]
    assert run_status == "finished"
    for iid in (LOST, DEAD):
        assert rows[iid] == ("INFRA_ERROR", "infra_error", False, "verdict_lost"), iid
        assert phases[iid].startswith("verdict_lost: "), phases[iid]
    assert "last sign of life" in phases[LOST] and "dead-letter queue" in phases[DEAD]
    assert {i: r[0] for i, r in rows.items() if i not in (LOST, DEAD)} == GRADED  # every other attempt graded
    assert all(r[1] not in (None, "infra_error") for i, r in rows.items() if i in GRADED and r[0] != "EMPTY_PATCH")

    report = json.loads((out / f"gpt-4o-mini.{unique}.json").read_text())
    assert report["infra_failure_ids"] == sorted([LOST, DEAD])  # never scored as the model's
    assert report["failure_reasons"] == {LOST: "verdict_lost", DEAD: "verdict_lost"}
    assert report["resolved_ids"] == ["evalplane__textkit-3"] and report["unresolved_ids"] == ["evalplane__calc-1"]
    assert report["error_ids"] == [] and report["empty_patch_ids"] == ["evalplane__textkit-2"]


def test_slow_grading_is_never_cut_off_and_a_verdict_lost_after_its_job_lands_once_the_queue_is_quiet(
        tmp_path, unique, pg, valkey, database_url, moto_endpoint, run_keys):
    """The driver's side alone, on a clock it is handed: while a grader holds a job (its message in flight), no
    attempt is declared lost, however long that takes; once the eval queue holds none for eval.verdict_wait_s, the
    attempt whose grader deleted its job without a verdict arriving lands as verdict_lost, and a verdict that
    comes after it changes nothing. Results and verdicts travel as a run's do: signed, on their own queues."""
    plan = make_plan(load_spec(spec_file(tmp_path, unique, verdict_wait_s=1)))
    runmod.open_run(pg, plan)
    res = resources.ensure(unique)
    slow, lost = (AttemptRef(run=unique, instance_id=i, attempt=1) for i in ("evalplane__calc-2", "evalplane__textkit-1"))
    writer = ResultsWriter(res, database_url, keys=run_keys)
    t = utcnow()

    def send_verdict(ref: AttemptRef) -> None:  # as an eval worker: on the verdict queue, signed with the verdict key
        aws.send(res.verdict_queue_url, Envelope(msg=Verdict(ref=ref, outcome=EvalOutcome.RESOLVED, resolved=True,
                                                             started_at=t, ended_at=utcnow())).model_dump_json(),
                 sign=signing.signer(run_keys.verdict_key))

    for ref in (slow, lost):
        aws.put_text(res.job_uri(ref), runmod.make_job(plan, res, ref, "http://u.invalid", "redis://v.invalid")
                     .model_dump_json())
        aws.put_text(res.artifacts_prefix(ref) + "patch.diff", "diff --git a/x b/x\n")
        aws.send(res.results_queue_url, Envelope(msg=AttemptResult(  # as its task: signed with the attempt's key
            ref=ref, harness="mini-swe-agent", pool=plan.spec.pool, model="gpt-4o-mini",
            outcome=HarnessOutcome.SUBMITTED, patch_uri=res.artifacts_prefix(ref) + "patch.diff", patch_bytes=20,
            started_at=t, ended_at=t)).model_dump_json(), sign=run_keys.attempt_signer(ref))
    while writer.poll_once(wait_s=0):  # lands both results and sends their eval jobs
        pass
    sqs = aws.client("sqs")
    jobs = sqs.receive_message(QueueUrl=res.eval_queue_url, MaxNumberOfMessages=10, VisibilityTimeout=600)["Messages"]
    held = {json.loads(m["Body"])["ref"]["instance_id"]: m["ReceiptHandle"] for m in jobs}
    assert set(held) == {slow.instance_id, lost.instance_id}
    sqs.delete_message(QueueUrl=res.eval_queue_url, ReceiptHandle=held[lost.instance_id])  # graded; its verdict never arrives

    def statuses() -> dict[str, str]:
        got = dict(pg.execute("SELECT instance_id, status FROM attempts WHERE run = %s", (unique,)).fetchall())
        pg.commit()
        return got

    loop = runmod.DriverLoop(plan, res, pg, valkey, None, None, None, run_keys)
    t0 = time.monotonic()
    loop._await_verdicts(t0)
    time.sleep(1.5)  # both jobs were sent longer ago than the bound
    loop._await_verdicts(t0 + 1000)  # the slow one still in flight: the queue is not quiet, nothing is lost
    assert statuses() == {slow.instance_id: "PATCH_READY", lost.instance_id: "PATCH_READY"}

    send_verdict(slow)  # graded at last
    assert writer.poll_once(wait_s=0) == 1
    sqs.delete_message(QueueUrl=res.eval_queue_url, ReceiptHandle=held[slow.instance_id])
    loop._await_verdicts(t0 + 1000.5)  # quiet, but not for the bound yet
    assert statuses() == {slow.instance_id: "RESOLVED", lost.instance_id: "PATCH_READY"}
    loop._await_verdicts(t0 + 1002)
    assert statuses() == {slow.instance_id: "RESOLVED", lost.instance_id: "INFRA_ERROR"} and loop.verdicts_lost == 1
    send_verdict(lost)  # too late: the first to land stays
    assert writer.poll_once(wait_s=0) == 1
    assert pg.execute("SELECT status, eval_outcome, report->>'infra_failure_reason' FROM attempts WHERE run = %s"
                      " AND instance_id = %s", (unique, lost.instance_id)).fetchone() == ("INFRA_ERROR", "infra_error",
                                                                               "verdict_lost")
    resources.remove_queues(res)
