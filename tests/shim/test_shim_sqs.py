"""Ledger batches to the results queue (moto): batching, retry of failed sends, flush on SIGTERM, no duplicates."""

from __future__ import annotations

import json
import signal
import time

import httpx
from shimtest import LOCAL_TOKEN, UPSTREAM_KEY

from contract import aws
from contract.models import Envelope, LedgerBatch

BODY = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hello"}]}


def _drain(queue_url: str) -> list[LedgerBatch]:
    sqs = aws.client("sqs")
    out = []
    while True:
        got = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0).get("Messages", [])
        if not got:
            return out
        for m in got:
            out.append(Envelope.model_validate_json(m["Body"]).msg)
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=m["ReceiptHandle"])


def _call(base: str, n: int) -> None:
    for _ in range(n):
        assert httpx.post(f"{base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=BODY).status_code == 200


def _wait(pred, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_batches_and_sigterm_flush(sim, shim, moto_endpoint, unique):
    queue = aws.client("sqs").create_queue(QueueName=unique)["QueueUrl"]
    s = shim(sim(), results_queue_url=queue, batch_size=3, batch_interval_s=60)
    _call(s.base, 7)
    _wait(lambda: s.status()["ledger_sent"] == 6)  # two full batches went at once; one row waits
    time.sleep(0.3)
    assert s.status()["ledger_sent"] == 6
    httpx.post(f"{s.base}/v1/nope", headers={"x-api-key": LOCAL_TOKEN}, json={})  # a 404 is a row too
    assert s.stop(signal.SIGTERM) == 0
    batches = _drain(queue)
    assert [len(b.rows) for b in batches] == [3, 3, 2]
    assert all(b.ref.run == unique for b in batches)
    seqs = [r.seq for b in batches for r in b.rows]
    assert sorted(seqs) == list(range(1, 9)) and len({r.call_id for b in batches for r in b.rows}) == 8
    status = json.loads((s.dir / "status.json").read_text())
    assert status["ledger_rows"] == 8 and status["ledger_sent"] == 8 and status["calls"] == 8
    assert status["unsent_seqs"] == []
    assert status["totals"]["calls"] == 8 and status["totals"]["cost_usd"] > 0
    local = [json.loads(line) for line in s.ledger_path.read_text().splitlines()]
    assert [r["call_id"] for r in local] == [str(r.call_id) for b in batches for r in b.rows]
    assert UPSTREAM_KEY not in s.log()


def test_failed_sends_are_retried_without_duplicates(sim, shim, moto_endpoint, unique):
    sqs = aws.client("sqs")
    live = sqs.create_queue(QueueName=f"{unique}-probe")["QueueUrl"]
    queue = live.rsplit("/", 1)[0] + f"/{unique}"  # not created yet: sends fail
    s = shim(sim(), results_queue_url=queue, batch_size=2, batch_interval_s=0.1)
    _call(s.base, 5)
    time.sleep(0.5)
    st = s.status()
    assert st["ledger_sent"] == 0 and st["ledger_rows"] == 5
    sqs.create_queue(QueueName=unique)
    _wait(lambda: s.status()["ledger_sent"] == 5)
    _call(s.base, 1)
    assert s.stop(signal.SIGINT) == 0
    rows = [r for b in _drain(queue) for r in b.rows]
    assert sorted(r.seq for r in rows) == [1, 2, 3, 4, 5, 6]
    assert "could not be sent" not in s.log()


def test_unsendable_rows_exit_nonzero(sim, shim, moto_endpoint, unique):
    live = aws.client("sqs").create_queue(QueueName=f"{unique}-probe")["QueueUrl"]
    s = shim(sim(), results_queue_url=live.rsplit("/", 1)[0] + f"/{unique}-never", batch_interval_s=0.1,
             sqs_flush_timeout_s=0.5)
    _call(s.base, 1)
    assert s.stop() == 3  # the rows are still in the local ledger for the task runner to resend
    assert len(s.rows()) == 1
    status = json.loads((s.dir / "status.json").read_text())
    assert status["ledger_rows"] == 1 and status["ledger_sent"] == 0
    assert status["unsent_seqs"] == [1]  # harness/task.py sends these rows with the attempt's result


def test_without_flush_on_exit_the_last_rows_are_left_for_the_result(sim, shim, moto_endpoint, unique):
    """flush_on_exit = false (what harness/task.py sets): full batches still go during the run; at SIGTERM the
    partial one stays, named by unsent_seqs, for the task to send inside the attempt's result."""
    queue = aws.client("sqs").create_queue(QueueName=unique)["QueueUrl"]
    s = shim(sim(), results_queue_url=queue, batch_size=3, batch_interval_s=60, flush_on_exit=False)
    _call(s.base, 4)
    _wait(lambda: s.status()["ledger_sent"] == 3)
    assert s.stop(signal.SIGTERM) == 0
    assert [r.seq for b in _drain(queue) for r in b.rows] == [1, 2, 3]
    status = json.loads((s.dir / "status.json").read_text())
    assert status["ledger_rows"] == 4 and status["ledger_sent"] == 3 and status["unsent_seqs"] == [4]
