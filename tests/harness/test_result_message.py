"""The task's last message: the result, carrying the ledger rows its shim left unsent, in one SQS message when
they fit, else the rows as batches first; against moto's SQS."""

from datetime import timedelta

from contract import aws
from contract.models import AttemptRef, AttemptResult, CallRecord, Envelope, HarnessOutcome, utcnow
from dispatcher.backends import resources
from harness import task


def rows(ref, n, pad=0):
    return [CallRecord(run=ref.run, instance_id=ref.instance_id, attempt=ref.attempt, seq=i + 1, pool="p",
                       provider="openai", model="m", route="/v1/chat/completions", input_tokens=10, output_tokens=5,
                       cost_usd=0.001, raw_usage={"pad": "x" * pad}) for i in range(n)]


def result(ref):
    t = utcnow()
    return AttemptResult(ref=ref, harness="h", pool="p", model="m", outcome=HarnessOutcome.SUBMITTED,
                         started_at=t - timedelta(seconds=1), ended_at=t)


def received(url):
    out = []
    while got := aws.client("sqs").receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages"):
        out += [Envelope.model_validate_json(m["Body"]).msg for m in got]
    return out


def test_unsent_rows_are_the_ones_the_shim_status_names(tmp_path):
    ref = AttemptRef(run="r", instance_id="a__b-1", attempt=1)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(r.model_dump_json() + "\n" for r in rows(ref, 5)))
    assert [r.seq for r in task.unsent_rows(ledger, {"unsent_seqs": [4, 5]})] == [4, 5]
    assert task.unsent_rows(ledger, {}) == []  # a shim that sent everything itself
    assert task.unsent_rows(tmp_path / "missing.jsonl", {"unsent_seqs": [1]}) == []


def test_result_carries_the_rows_in_one_message_or_sends_them_first(moto_endpoint, unique):
    res = resources.ensure(unique)
    small = AttemptRef(run=unique, instance_id="a__b-1", attempt=1)
    task.send_result(res.results_queue_url, result(small), rows(small, 10))
    (msg,) = received(res.results_queue_url)
    assert msg.kind == "attempt_result" and [r.seq for r in msg.ledger] == list(range(1, 11))

    big = AttemptRef(run=unique, instance_id="a__b-2", attempt=1)
    task.send_result(res.results_queue_url, result(big), rows(big, 300, pad=2000))  # ~700 KB of rows
    msgs = received(res.results_queue_url)
    batches = [m for m in msgs if m.kind == "ledger"]
    (res_msg,) = [m for m in msgs if m.kind == "attempt_result"]
    assert sorted(r.seq for b in batches for r in b.rows) == list(range(1, 301)) and res_msg.ledger == []
    resources.remove_queues(res)


def test_artifacts_that_cannot_be_stored_are_named_not_fatal(moto_endpoint, unique, tmp_path):
    """A failed upload does not stop the task from sending its result: it is named in the result's error."""
    res = resources.ensure(unique)
    (tmp_path / "trajectory.json").write_text("{}")
    (tmp_path / "ledger.jsonl").write_text("{}\n")
    ok = task.store_artifacts(f"s3://{res.bucket}/runs/{unique}/attempts/a__b-1/1/", tmp_path, "diff --git a b\n")
    assert ok[0].endswith("/patch.diff") and ok[1].endswith("/trajectory.json") and ok[2] == []
    missing = task.store_artifacts(f"s3://no-such-bucket-{unique}/x/", tmp_path, "diff --git a b\n")
    assert missing[:2] == (None, None)
    assert [p.split(" ")[0] for p in missing[2]] == ["patch.diff", "trajectory.json", "ledger.jsonl"]
    assert task.store_artifacts(f"s3://{res.bucket}/y/", tmp_path / "empty", "") == (None, None, [])
    resources.remove_queues(res)


def test_the_shim_log_is_stored_beside_the_attempt_its_tail_when_long(moto_endpoint, unique, tmp_path, monkeypatch):
    """Why a call failed is in the shim's log, which lives in the task's own folder: the task stores its tail."""
    res = resources.ensure(unique)
    monkeypatch.setattr(task, "SHIM_LOG_TAIL", 1000)
    (tmp_path / "shim.log").write_text("old line\n" * 500 + "upstream 529 (attempt 1), retrying\n")
    prefix = f"s3://{res.bucket}/runs/{unique}/attempts/a__b-1/1/"
    assert task.store_artifacts(prefix, tmp_path, "diff --git a b\n")[2] == []
    stored = aws.get_text(prefix + "shim.log")
    assert len(stored) == 1000 and stored.endswith("upstream 529 (attempt 1), retrying\n")
    resources.remove_queues(res)
