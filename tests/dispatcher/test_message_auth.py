"""The results writer lands only what may land (dispatcher/driver/message_auth.py), against the real PostgreSQL and moto:
a task holds its own attempt's key and can send to the results queue, so every forgery below is one a task could
try; none lands, each is dead-lettered with its reason, and the genuine messages beside them land as before."""

from __future__ import annotations

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
    EvalOutcome,
    HarnessOutcome,
    HarnessRef,
    Job,
    LedgerBatch,
    ModelRef,
    TamperFlag,
    Totals,
    Verdict,
    utcnow,
)
from contract.signing import REJECTED_ATTRIBUTE
from dispatcher.backends import resources
from dispatcher.driver.writer import ResultsWriter


@pytest.fixture
def run(pg, moto_endpoint, unique, database_url, run_keys):
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'local', 3)",
               (unique, Jsonb({})))
    pg.commit()
    res = resources.ensure(unique)
    yield res, ResultsWriter(res, database_url, keys=run_keys), run_keys
    resources.remove_queues(res)


def rows(ref: AttemptRef, n: int, seq0: int = 1) -> list[CallRecord]:
    return [CallRecord(run=ref.run, instance_id=ref.instance_id, attempt=ref.attempt, seq=seq0 + i, pool="p",
                       provider="openai", model="m", route="/v1/chat/completions", input_tokens=10, output_tokens=5,
                       cost_usd=0.001) for i in range(n)]


def result(ref: AttemptRef, patch_uri: str | None = None, patch_bytes: int = 0) -> AttemptResult:
    t = utcnow()
    return AttemptResult(ref=ref, harness="mini-swe-agent", pool="p", model="m", outcome=HarnessOutcome.SUBMITTED,
                         patch_uri=patch_uri, patch_bytes=patch_bytes, totals=Totals(),
                         started_at=t - timedelta(seconds=5), ended_at=t)


def verdict(ref: AttemptRef, **kw) -> Verdict:
    t = utcnow()
    return Verdict(ref=ref, outcome=EvalOutcome.RESOLVED, resolved=True, report={"resolved": True}, started_at=t,
                   ended_at=t, **kw)


def body(msg) -> str:
    return Envelope(msg=msg).model_dump_json()


def drain(writer) -> None:
    while writer.poll_once(wait_s=0):
        pass


def dead_letters(res) -> list[tuple[str, str]]:
    """The results DLQ: (message kind and ref, the reason the writer gave), sorted."""
    sqs = aws.client("sqs")
    out = []
    while got := sqs.receive_message(QueueUrl=res.results_dlq_url, MaxNumberOfMessages=10, WaitTimeSeconds=0,
                                     MessageAttributeNames=[REJECTED_ATTRIBUTE]).get("Messages", []):
        for m in got:
            msg = Envelope.model_validate_json(m["Body"]).msg
            out.append((f"{msg.kind} {msg.ref.run[-1]}{msg.ref.slug}", m["MessageAttributes"][REJECTED_ATTRIBUTE][
                "StringValue"]))
            sqs.delete_message(QueueUrl=res.results_dlq_url, ReceiptHandle=m["ReceiptHandle"])
    return sorted(out)


def patched(res, ref: AttemptRef) -> str:
    """An attempt with a patch (its job document and patch in S3), as a task leaves it."""
    job = Job(ref=ref, harness=HarnessRef(name="mini-swe-agent"), model=ModelRef(provider="openai", model="m", pool="p"),
              limits=AttemptLimits(), instance={"instance_id": ref.instance_id, "base_commit": "abc"},
              repo_source="/x.bundle", upstream_url="http://u.invalid", results_queue_url=res.results_queue_url,
              artifacts_prefix=res.artifacts_prefix(ref), valkey_url="redis://v.invalid")
    aws.put_text(res.job_uri(ref), job.model_dump_json())
    uri = res.artifacts_prefix(ref) + "patch.diff"
    aws.put_text(uri, "diff --git a/x b/x\n")
    return uri


def test_forged_verdicts_and_results_never_land(run, pg):
    res, writer, keys = run
    mine, other, third = (AttemptRef(run=res.run, instance_id=f"a__b-{i}", attempt=1) for i in (1, 2, 3))
    sign_mine = keys.attempt_signer(mine)  # all a task (of `mine`) holds
    for ref in (mine, other):
        uri = patched(res, ref)
        aws.send(res.results_queue_url, body(result(ref, uri, 20)), sign=keys.attempt_signer(ref))
    drain(writer)
    assert dict(pg.execute("SELECT instance_id, status FROM attempts WHERE run=%s", (res.run,)).fetchall()) == {
        "a__b-1": "PATCH_READY", "a__b-2": "PATCH_READY"}
    assert dead_letters(res) == []

    # what the attempt's task could send: its own verdict on the results queue (signed with its own key, or not);
    # a verdict on the verdict queue unsigned, or signed with its attempt key; a result naming another attempt; a
    # batch of its own carrying another attempt's rows; a result of another run
    aws.send(res.results_queue_url, body(verdict(mine)), sign=sign_mine)
    aws.send(res.results_queue_url, body(verdict(other)))
    aws.send(res.verdict_queue_url, body(verdict(mine)))
    aws.send(res.verdict_queue_url, body(verdict(other)), sign=sign_mine)
    aws.send(res.results_queue_url, body(result(third)), sign=sign_mine)
    aws.send(res.results_queue_url, body(LedgerBatch(ref=mine, rows=rows(third, 2))), sign=sign_mine)
    aws.send(res.results_queue_url, body(result(AttemptRef(run=res.run + "x", instance_id="a__b-1", attempt=1))),
             sign=sign_mine)
    aws.send(res.results_queue_url, body(LedgerBatch(ref=third, rows=rows(third, 2))))  # unsigned
    # and, beside them, what genuinely may land: its own ledger rows, and the eval fleet's verdict
    aws.send(res.results_queue_url, body(LedgerBatch(ref=mine, rows=rows(mine, 2))), sign=sign_mine)
    flags = [TamperFlag(rule="conftest", files=["tests/conftest.py"])]
    aws.send(res.verdict_queue_url, body(verdict(other, tamper_flags=flags)), sign=signing.signer(keys.verdict_key))
    drain(writer)

    got = {i: (s, f) for i, s, f in pg.execute(
        "SELECT instance_id, status, tamper_flags FROM attempts WHERE run=%s", (res.run,)).fetchall()}
    assert got == {"a__b-1": ("PATCH_READY", None),  # no forged verdict landed for it
                   "a__b-2": ("RESOLVED", [{"rule": "conftest", "files": ["tests/conftest.py"]}])}
    calls = pg.execute("SELECT instance_id, count(*) FROM calls WHERE run=%s GROUP BY 1", (res.run,)).fetchall()
    assert calls == [("a__b-1", 2)]  # its own rows only; none for a__b-3
    r = res.run[-1]
    dead = dead_letters(res)
    expected = [
        (f"attempt_result {r}a__b-3/1", "not signed with that attempt's key"),
        ("attempt_result xa__b-1/1", f"names run {res.run + 'x'!r}, not {res.run!r}"),
        (f"ledger {r}a__b-1/1", "carries 2 ledger rows of other attempts"),
        (f"ledger {r}a__b-3/1", "not signed with that attempt's key"),
        (f"verdict {r}a__b-1/1", "on the results queue (verdicts come only on the verdict queue)"),
        (f"verdict {r}a__b-1/1", "not signed with the verdict key"),
        (f"verdict {r}a__b-2/1", "on the results queue (verdicts come only on the verdict queue)"),
        (f"verdict {r}a__b-2/1", "not signed with the verdict key"),
    ]
    assert [what for what, _ in dead] == [what for what, _ in expected]
    assert all(frag in why for (_, why), (_, frag) in zip(dead, expected)), dead
    assert writer.landed == {"ledger": 1, "attempt_result": 2, "verdict": 1}


def test_a_forged_s3_copy_is_not_landed(run, pg):
    """The driver lands a gone task's S3 copies: one its attempt's key did not sign (another task's upload) is
    ignored, and the attempt lands as lost with only its genuine rows."""
    res, writer, keys = run
    ref = AttemptRef(run=res.run, instance_id="a__b-4", attempt=1)
    prefix = res.artifacts_prefix(ref)
    aws.put_text(aws.result_copy_uri(prefix), body(result(ref).model_copy(update={"outcome": HarnessOutcome.SUBMITTED})),
                 sign=keys.attempt_signer(AttemptRef(run=res.run, instance_id="a__b-5", attempt=1)))
    aws.put_text(aws.ledger_copy_uri(prefix), "".join(r.model_dump_json() + "\n" for r in rows(ref, 3)))  # unsigned
    how = writer.land_unreported(ref, lambda got: result(ref).model_copy(
        update={"outcome": HarnessOutcome.INFRA_ERROR, "error": f"lost_result: {len(got)} rows"}))
    assert how == "lost"
    assert pg.execute("SELECT status, error FROM attempts WHERE run=%s", (res.run,)).fetchall() == [
        ("INFRA_ERROR", "lost_result: 0 rows")]
    # the same copies, signed by the attempt's own task, land
    good = AttemptRef(run=res.run, instance_id="a__b-6", attempt=1)
    sign = keys.attempt_signer(good)
    aws.put_text(aws.ledger_copy_uri(res.artifacts_prefix(good)),
                 "".join(r.model_dump_json() + "\n" for r in rows(good, 3)), sign=sign)
    aws.put_text(aws.result_copy_uri(res.artifacts_prefix(good)), body(result(good)), sign=sign)
    assert writer.land_unreported(good, None) == "copy"
    assert pg.execute("SELECT count(*) FROM calls WHERE run=%s AND instance_id='a__b-6'", (res.run,)).fetchone()[0] == 3
