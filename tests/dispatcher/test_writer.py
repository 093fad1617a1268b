"""The results writer against the real PostgreSQL and moto's SQS/S3: idempotent landing, eval only for patches."""

import json
from datetime import timedelta

import pytest
from psycopg.types.json import Jsonb

from contract import aws, signing
from contract.models import (
    AttemptLimits,
    AttemptRef,
    AttemptResult,
    CallRecord,
    Envelope,
    EvalJob,
    EvalOutcome,
    HarnessOutcome,
    HarnessRef,
    Job,
    LedgerBatch,
    ModelRef,
    Totals,
    Verdict,
    utcnow,
)
from dispatcher.backends import resources
from dispatcher.driver.writer import ResultsWriter


@pytest.fixture
def run(pg, moto_endpoint, unique, database_url, run_keys):
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'local', 2)",
               (unique, Jsonb({})))
    pg.commit()
    res = resources.ensure(unique)
    return res, ResultsWriter(res, database_url, keys=run_keys)


def job_for(res, ref):
    job = Job(ref=ref, harness=HarnessRef(name="mini-swe-agent"), model=ModelRef(provider="openai", model="m", pool="p"),
              limits=AttemptLimits(), instance={"instance_id": ref.instance_id, "base_commit": "abc"},
              repo_source="/x.bundle", upstream_url="http://u", results_queue_url=res.results_queue_url,
              artifacts_prefix=res.artifacts_prefix(ref), valkey_url="redis://x")
    aws.put_text(res.job_uri(ref), job.model_dump_json())


def calls(ref, n):
    return [CallRecord(run=ref.run, instance_id=ref.instance_id, attempt=ref.attempt, seq=i + 1, pool="p",
                       provider="openai", model="m", route="/v1/chat/completions", input_tokens=10, output_tokens=5,
                       cost_usd=0.001) for i in range(n)]


def result(ref, patch_bytes, patch_uri=None):
    t = utcnow()
    return AttemptResult(ref=ref, harness="mini-swe-agent", pool="p", model="m", outcome=HarnessOutcome.SUBMITTED,
                         patch_uri=patch_uri, patch_bytes=patch_bytes, ledger_calls=3,
                         totals=Totals(calls=3, input_tokens=30, output_tokens=15, cost_usd=0.003),
                         started_at=t - timedelta(seconds=5), ended_at=t)


def send_all(writer, msgs):
    """As their senders send them: a task's signed with its attempt's key on the results queue, a verdict signed
    with the verdict key on the verdict queue."""
    for m in msgs:
        if isinstance(m, Verdict):
            aws.send(writer.res.verdict_queue_url, Envelope(msg=m).model_dump_json(),
                     sign=signing.signer(writer.auth.keys.verdict_key))
        else:
            send_body(writer, m.ref, Envelope(msg=m).model_dump_json())


def send_body(writer, ref, body: str):
    aws.send(writer.res.results_queue_url, body, sign=writer.auth.keys.attempt_signer(ref))


def drain(writer):
    while writer.poll_once(wait_s=0):
        pass


def eval_jobs(res):
    got = aws.client("sqs").receive_message(QueueUrl=res.eval_queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0)
    return [EvalJob.model_validate_json(m["Body"]) for m in got.get("Messages", [])]


def test_redelivered_messages_land_once_and_only_patches_reach_the_grader(run, pg):
    res, writer = run
    with_patch = AttemptRef(run=res.run, instance_id="a__b-1", attempt=1)
    empty = AttemptRef(run=res.run, instance_id="a__b-2", attempt=1)
    job_for(res, with_patch)
    aws.put_text(res.artifacts_prefix(with_patch) + "patch.diff", "diff --git a/x b/x\n")
    ledger = LedgerBatch(ref=with_patch, rows=calls(with_patch, 3))
    msgs = [ledger, result(with_patch, 20, res.artifacts_prefix(with_patch) + "patch.diff"),
            LedgerBatch(ref=empty, rows=calls(empty, 3)), result(empty, 0)]
    send_all(writer, msgs + msgs)  # every message delivered twice
    drain(writer)

    rows = dict(pg.execute("SELECT instance_id, status FROM attempts WHERE run=%s", (res.run,)).fetchall())
    assert rows == {"a__b-1": "PATCH_READY", "a__b-2": "EMPTY_PATCH"}
    assert pg.execute("SELECT count(*) FROM calls WHERE run=%s", (res.run,)).fetchone()[0] == 6
    assert pg.execute("SELECT count(*) FROM phases WHERE run=%s", (res.run,)).fetchone()[0] == 2
    jobs = eval_jobs(res)
    assert [j.ref for j in jobs] == [with_patch]
    assert jobs[0].instance["base_commit"] == "abc" and jobs[0].patch_uri.endswith("patch.diff")
    tot = pg.execute("SELECT calls, input_tokens, output_tokens, cost_usd FROM attempts WHERE run=%s AND instance_id='a__b-1'",
                     (res.run,)).fetchone()
    assert tot[:3] == (3, 30, 15) and float(tot[3]) == pytest.approx(0.003)
    assert aws.client("sqs").get_queue_attributes(QueueUrl=res.results_queue_url, AttributeNames=[
        "ApproximateNumberOfMessages"])["Attributes"]["ApproximateNumberOfMessages"] == "0"

    t = utcnow()
    verdict = Verdict(ref=with_patch, outcome=EvalOutcome.RESOLVED, resolved=True, report={"resolved": True},
                      started_at=t, ended_at=t)
    send_all(writer, [verdict, verdict])
    drain(writer)
    assert pg.execute("SELECT status, resolved FROM attempts WHERE run=%s AND instance_id='a__b-1'",
                      (res.run,)).fetchone() == ("RESOLVED", True)
    assert pg.execute("SELECT count(*) FROM phases WHERE run=%s AND phase='eval'", (res.run,)).fetchone()[0] == 1


def test_sweep_enqueues_committed_but_unsent_eval_jobs(run, pg):
    res, writer = run
    ref = AttemptRef(run=res.run, instance_id="a__b-3", attempt=1)
    job_for(res, ref)
    writer.land([Envelope(msg=result(ref, 10, res.artifacts_prefix(ref) + "patch.diff"))])  # crash before enqueue
    assert eval_jobs(res) == []
    assert writer.sweep() == 1
    assert [j.ref for j in eval_jobs(res)] == [ref]
    assert writer.sweep() == 0  # marked as enqueued


def test_unreadable_message_is_not_deleted(run):
    res, writer = run
    aws.send(res.results_queue_url, json.dumps({"msg": {"kind": "nonsense"}}))
    assert writer.poll_once(wait_s=0) == 0


def test_rows_riding_with_the_result_land_with_it_once(run, pg):
    """A task's last ledger rows come inside its result message; a row also sent in a batch (a shim that sent it
    just before stopping) and a redelivered result both land once."""
    res, writer = run
    ref = AttemptRef(run=res.run, instance_id="a__b-4", attempt=1)
    rows = calls(ref, 3)
    send_all(writer, [LedgerBatch(ref=ref, rows=rows[:1])])
    with_rows = result(ref, 0).model_copy(update={"ledger": rows[1:] + rows[:1]})
    send_all(writer, [with_rows, with_rows])
    drain(writer)
    got = pg.execute("SELECT seq FROM calls WHERE run=%s AND instance_id=%s ORDER BY seq", (res.run, ref.instance_id))
    assert [r[0] for r in got.fetchall()] == [1, 2, 3]
    assert pg.execute("SELECT count(*) FROM attempts WHERE run=%s AND instance_id=%s",
                      (res.run, ref.instance_id)).fetchone()[0] == 1


def test_a_row_the_database_refuses_keeps_only_its_own_message_back(run, pg):
    """Ledger rows are typed by PostgreSQL: a bad value fails the batch, the batch is landed message by message,
    and only the refused message stays on the queue (for its dead-letter queue). A field left out takes the
    model's default."""
    res, writer = run
    good = AttemptRef(run=res.run, instance_id="a__b-5", attempt=1)
    bad = AttemptRef(run=res.run, instance_id="a__b-6", attempt=1)
    rows = [r.model_dump(mode="json") for r in calls(good, 2)]
    del rows[0]["stream"], rows[0]["retries"]  # a producer that leaves defaults out
    bad_rows = [r.model_dump(mode="json") for r in calls(bad, 2)]
    bad_rows[1]["input_tokens"] = "many"
    for ref, rs in ((good, rows), (bad, bad_rows)):
        send_body(writer, ref, json.dumps({"msg": {"kind": "ledger", "ref": ref.model_dump(), "rows": rs}}))
    send_all(writer, [result(good, 0)])
    drain(writer)
    got = pg.execute("SELECT instance_id, count(*), bool_or(stream), sum(retries) FROM calls WHERE run=%s"
                     " GROUP BY instance_id", (res.run,)).fetchall()
    assert got == [("a__b-5", 2, False, 0)]
    assert pg.execute("SELECT count(*) FROM attempts WHERE run=%s", (res.run,)).fetchone()[0] == 1
    left = aws.client("sqs").get_queue_attributes(QueueUrl=res.results_queue_url, AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    assert int(left["ApproximateNumberOfMessages"]) + int(left["ApproximateNumberOfMessagesNotVisible"]) == 1


def test_an_infra_error_recovers_the_ledger_rows_of_the_tasks_s3_copy(run, pg):
    """A task that died after uploading its ledger copy but before sending its result: the dispatcher lands it as
    infra_error, and the writer lands the copy's rows (the ones already sent in a batch only once)."""
    res, writer = run
    ref = AttemptRef(run=res.run, instance_id="a__b-7", attempt=1)
    rows = calls(ref, 3)
    send_all(writer, [LedgerBatch(ref=ref, rows=rows[:1])])
    drain(writer)
    aws.put_text(res.artifacts_prefix(ref) + "ledger.jsonl", "".join(r.model_dump_json() + "\n" for r in rows),
                 sign=writer.auth.keys.attempt_signer(ref))
    t = utcnow()
    send_all(writer, [AttemptResult(ref=ref, harness="mini-swe-agent", pool="p", model="m",
                                 outcome=HarnessOutcome.INFRA_ERROR, started_at=t, ended_at=t,
                                 error="task exited with code -9 without a result")])
    drain(writer)
    got = pg.execute("SELECT seq FROM calls WHERE run=%s AND instance_id=%s ORDER BY seq", (res.run, ref.instance_id))
    assert [r[0] for r in got.fetchall()] == [1, 2, 3]
    assert pg.execute("SELECT outcome FROM attempts WHERE run=%s AND instance_id=%s",
                      (res.run, ref.instance_id)).fetchone() == ("infra_error",)


def test_a_result_whose_rows_are_refused_still_lands_its_attempt(run, pg):
    """Every attempt lands a row: a result carrying a row the database refuses lands without it, and the rows go
    back to the queue as a batch of their own (refused again there, on their way to the dead-letter queue)."""
    res, writer = run
    ref = AttemptRef(run=res.run, instance_id="a__b-8", attempt=1)
    rows = [r.model_dump(mode="json") for r in calls(ref, 2)]
    rows[0]["output_tokens"] = "lots"
    body = json.loads(Envelope(msg=result(ref, 0)).model_dump_json())
    body["msg"]["ledger"] = rows
    send_body(writer, ref, json.dumps(body))
    drain(writer)
    assert pg.execute("SELECT status FROM attempts WHERE run=%s AND instance_id=%s",
                      (res.run, ref.instance_id)).fetchone() == ("EMPTY_PATCH",)
    assert pg.execute("SELECT count(*) FROM calls WHERE run=%s", (res.run,)).fetchone()[0] == 0
    left = aws.client("sqs").get_queue_attributes(QueueUrl=res.results_queue_url, AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    assert int(left["ApproximateNumberOfMessages"]) + int(left["ApproximateNumberOfMessagesNotVisible"]) == 1


def test_infrastructure_failures_land_as_such_never_graded_nor_as_empty_patches(run, pg):
    """A task that failed before the agent could work (no checkout), or whose upstream refused past every retry
    (with a patch on disk), lands INFRA_ERROR: not EMPTY_PATCH, never sent to the grader; an eval verdict of
    infra_error likewise."""
    res, writer = run
    setup, limited, graded = (AttemptRef(run=res.run, instance_id=f"a__b-{i}", attempt=1) for i in (20, 21, 22))
    for ref in (limited, graded):
        job_for(res, ref)
        aws.put_text(res.artifacts_prefix(ref) + "patch.diff", "diff --git a/x b/x\n")
    failed = result(setup, 0).model_copy(update={"outcome": HarnessOutcome.INFRA_ERROR, "error": "setup failed: x"})
    rate = result(limited, 20, res.artifacts_prefix(limited) + "patch.diff").model_copy(
        update={"outcome": HarnessOutcome.INFRA_ERROR, "error": "rate_limited: upstream"})
    send_all(writer, [failed, rate, result(graded, 20, res.artifacts_prefix(graded) + "patch.diff")])
    drain(writer)
    assert [j.ref for j in eval_jobs(res)] == [graded]
    t = utcnow()
    send_all(writer, [Verdict(ref=graded, outcome=EvalOutcome.INFRA_ERROR, resolved=False, reason="environment_broken",
                           report={"infra_failure": True, "infra_failure_reason": "environment_broken"},
                           started_at=t, ended_at=t)])
    drain(writer)
    rows = dict(pg.execute("SELECT instance_id, status FROM attempts WHERE run=%s", (res.run,)).fetchall())
    assert rows == {"a__b-20": "INFRA_ERROR", "a__b-21": "INFRA_ERROR", "a__b-22": "INFRA_ERROR"}


def test_a_batch_with_a_row_already_landed_lands_again_whole_through_the_staging_table(run, pg):
    """No savepoint guards the COPY: a redelivered message's row fails the batch's transaction, and the batch is
    landed again in a new one through the staging table; its new rows and attempt land once, the repeat is absorbed,
    and only that batch pays the second transaction."""
    res, writer = run
    old, new = (AttemptRef(run=res.run, instance_id=f"a__b-{i}", attempt=1) for i in (30, 31))
    first = LedgerBatch(ref=old, rows=calls(old, 2))
    send_all(writer, [first])
    drain(writer)
    assert writer.redelivered_batches == 0
    send_all(writer, [LedgerBatch(ref=new, rows=calls(new, 3)), first, result(new, 0).model_copy(
        update={"ledger": calls(new, 4)[3:]})])  # the repeat in the middle of a batch with new rows and a result
    assert writer.poll_once(wait_s=0) == 3
    assert writer.redelivered_batches == 1
    got = dict(pg.execute("SELECT instance_id, count(*) FROM calls WHERE run=%s GROUP BY 1", (res.run,)).fetchall())
    assert got == {"a__b-30": 2, "a__b-31": 4}
    assert pg.execute("SELECT status FROM attempts WHERE run=%s AND instance_id='a__b-31'",
                      (res.run,)).fetchone() == ("EMPTY_PATCH",)
    assert writer.state()["batches"] == 2


def test_an_attempts_resources_compute_and_grading_time_land_in_its_row(run, pg):
    from contract.models import ComputeUsage, TaskResources

    res, writer = run
    ref = AttemptRef(run=res.run, instance_id="i-compute", attempt=1)
    job_for(res, ref)
    r = result(ref, 10, "s3://b/p").model_copy(update={
        "resources": TaskResources(cpu=2.0, memory_mib=2048, memory_limit_mib=6144),
        "usage": ComputeUsage(source="cgroup", cpu_s=41.25, memory_peak_bytes=812 * 2**20, wall_s=95.5)})
    send_all(writer, [r])
    drain(writer)
    t = utcnow()
    send_all(writer, [Verdict(ref=ref, outcome=EvalOutcome.RESOLVED, resolved=True, started_at=t - timedelta(seconds=42),
                              ended_at=t, grading_cpu_s=12.5)])
    drain(writer)
    row = pg.execute(
        "SELECT task_cpu, task_memory_mib, task_memory_limit_mib, task_cpu_s, task_memory_peak_bytes, task_wall_s,"
        " usage_source, grading_wall_s, grading_cpu_s, status FROM attempts WHERE run = %s", (res.run,)).fetchone()
    assert row == (2.0, 2048, 6144, 41.25, 812 * 2**20, 95.5, "cgroup", pytest.approx(42.0), 12.5, "RESOLVED")
