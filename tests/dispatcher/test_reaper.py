"""The run always ends: every attempt whose task is gone gets its row, whatever its progress key says.

A task that died without marking its result sent is landed after a short grace; one that marked it gets
backend.result_wait_s for its row to come through the queue, then the driver lands it itself: from the task's S3
copy of its result if it left one, else as infra_error (lost_result) with the rows of its S3 ledger copy.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from contract import aws, keys
from contract.models import (
    AttemptRef,
    AttemptResult,
    CallRecord,
    Envelope,
    HarnessOutcome,
    LedgerBatch,
    Totals,
    utcnow,
)
from dispatcher import report
from dispatcher.backends import resources
from dispatcher.driver import loop as runmod
from dispatcher.driver.writer import ResultsWriter
from dispatcher.launchers.base import Launcher, TaskHandle
from dispatcher.plan import make_plan
from dispatcher.spec import load_spec
from harness import task

SYNTHETIC = Path(__file__).resolve().parents[2] / "examples" / "synthetic"


def spec_file(tmp_path: Path, run: str, result_wait_s: float, attempts: int = 1, concurrency: int = 5,
              pool: str | None = None, ids: list[str] | None = None) -> Path:
    """A process-launcher spec over the synthetic instances (a pool of its own, some of them, if given)."""
    p = tmp_path / "spec.toml"
    p.write_text(f"""
[run]
name = "{run}"
attempts = {attempts}
[harness]
name = "mini-swe-agent"
[model]
provider = "openai"
model = "gpt-4o-mini"
{f'pool = "{pool}"' if pool else ""}
[instances]
dataset = "{SYNTHETIC}/instances.jsonl"
repos = "{SYNTHETIC}/repos"
{f"ids = {json.dumps(ids)}" if ids else ""}
[budget]
run_usd = 1
wall_time_s = 60
[backend]
concurrency = {concurrency}
result_wait_s = {result_wait_s}
""")
    return p


def opened(tmp_path, run, pg, result_wait_s: float):
    plan = make_plan(load_spec(spec_file(tmp_path, run, result_wait_s)))
    runmod.open_run(pg, plan)
    return plan


@pytest.fixture
def plan(tmp_path, unique, pg, moto_endpoint):
    return opened(tmp_path, unique, pg, result_wait_s=2)


def ledger(ref: AttemptRef, n: int) -> list[CallRecord]:
    t = utcnow() - timedelta(seconds=30)
    return [CallRecord(run=ref.run, instance_id=ref.instance_id, attempt=ref.attempt, seq=i + 1, pool="p",
                       provider="openai", model="gpt-4o-mini", route="/v1/chat/completions",
                       started_at=t + timedelta(seconds=i), input_tokens=100, output_tokens=10, cost_usd=0.01)
                 for i in range(n)]


def result(ref: AttemptRef, rows: list[CallRecord]) -> AttemptResult:
    t = utcnow()
    return AttemptResult(ref=ref, harness="mini-swe-agent", pool="p", model="gpt-4o-mini",
                         outcome=HarnessOutcome.SUBMITTED, ledger_calls=len(rows), totals=Totals.of(rows),
                         started_at=t - timedelta(seconds=30), ended_at=t)


class ThreadTasks(Launcher):
    """Each task a thread playing a task's end as harness/task.py does (its ledger copy to S3, one ledger batch
    during the run, its result through task.send_result, its "done" mark), or not, as `plays` says per instance."""

    def __init__(self, res, valkey, plays: dict[str, str], sink_queue: str, run_keys):
        self.res, self.valkey, self.plays, self.sink = res, valkey, plays, sink_queue
        self.run_keys = run_keys
        self.threads: dict[str, threading.Thread] = {}
        self.codes: dict[str, int] = {}

    def _task(self, ref: AttemptRef) -> None:
        play, rows = self.plays[ref.instance_id], ledger(ref, 3)
        prefix, sign = self.res.artifacts_prefix(ref), self.run_keys.attempt_signer(ref)  # the task's attempt key
        aws.put_text(aws.ledger_copy_uri(prefix), "".join(r.model_dump_json() + "\n" for r in rows), sign=sign)
        aws.send(self.res.results_queue_url, Envelope(msg=LedgerBatch(ref=ref, rows=rows[:1])).model_dump_json(),
                 sign=sign)
        if play == "crash":  # dies before its result: no mark, no copy
            self.codes[ref.instance_id] = -9
            return
        # "drop": the result is killed on its way (it goes to a queue nobody reads) and the task left no copy of it;
        # "drop, copy kept": killed on its way, but its copy is in S3
        queue = self.res.results_queue_url if play == "normal" else self.sink
        copy = aws.result_copy_uri(prefix) if play in ("normal", "drop, copy kept") else None
        task.send_result(queue, result(ref, rows), rows[1:], copy, sign)
        self.valkey.hset(keys.progress(ref), mapping={"phase": "done", "outcome": "submitted"})
        self.valkey.expire(keys.progress(ref), 600)
        self.codes[ref.instance_id] = 0

    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        t = self.threads[ref.instance_id] = threading.Thread(target=self._task, args=(ref,))
        t.start()
        return TaskHandle(ref=ref, task_id=ref.instance_id)

    def poll(self, handle: TaskHandle) -> int | None:
        return None if self.threads[handle.task_id].is_alive() else self.codes.get(handle.task_id, -1)

    def stop(self, handle: TaskHandle) -> None:
        pass


def test_a_result_killed_on_its_way_still_lands_and_the_run_ends(plan, pg, valkey, database_url, monkeypatch,
                                                                 run_keys):
    """The acceptance test of issue 26: results dropped on their way (the bench's bench__sim-616: marked done, exit
    0, no message anywhere). The run ends; the one without a copy is infra_error/lost_result with every row of its
    S3 ledger copy, the one with a copy lands as what it was; a crashed task is task_died; no attempt is lost."""
    monkeypatch.setattr(runmod, "REAP_GRACE_S", 0.5)
    run = plan.spec.run.name
    res = resources.ensure(run)
    sink = aws.client("sqs").create_queue(QueueName=f"{run}-sink")["QueueUrl"]
    plays = {"evalplane__calc-1": "normal", "evalplane__calc-2": "drop", "evalplane__textkit-1": "drop, copy kept",
             "evalplane__textkit-2": "crash", "evalplane__textkit-3": "normal"}
    tasks = ThreadTasks(res, valkey, plays, sink, run_keys)
    loop = runmod.DriverLoop(plan, res, pg, valkey, tasks, None,
                             lambda ref: runmod.make_job(plan, res, ref, "http://u.invalid", "redis://v.invalid"),
                             run_keys)
    loop._next_plan, loop.target = float("inf"), 5  # no pacer here: the fleet size is set
    writer = ResultsWriter(res, database_url, keys=run_keys)
    stop = threading.Event()
    consumer = threading.Thread(target=writer.run_until, args=(stop,), daemon=True)
    consumer.start()
    t0 = time.monotonic()
    try:
        while not loop.step():
            assert time.monotonic() - t0 < 60, "the run did not end"
            time.sleep(0.2)
    finally:
        stop.set()
        consumer.join(10)
    ended_in = time.monotonic() - t0
    assert ended_in >= 2  # the dropped ones waited out backend.result_wait_s (2 s), not less

    rows = {r[0]: r[1:] for r in pg.execute(
        "SELECT instance_id, outcome, status, error, calls, cost_usd FROM attempts WHERE run = %s", (run,))}
    assert set(rows) == set(plays)  # every attempt exactly one row (the key allows no second)
    lost = rows["evalplane__calc-2"]
    assert lost[:2] == ("infra_error", "INFRA_ERROR") and lost[2].startswith("lost_result: ")
    assert lost[3] == 3 and float(lost[4]) == pytest.approx(0.03)  # its spend, from the ledger copy
    assert report.infra_reason({"error": lost[2]}) == "lost_result"
    assert rows["evalplane__textkit-1"][:3] == ("submitted", "EMPTY_PATCH", None)  # landed from its S3 copy
    assert rows["evalplane__textkit-2"][:2] == ("infra_error", "INFRA_ERROR")
    assert report.infra_reason({"error": rows["evalplane__textkit-2"][2]}) == "task_died"
    assert {rows[i][1] for i in ("evalplane__calc-1", "evalplane__textkit-3")} == {"EMPTY_PATCH"}
    calls = dict(pg.execute("SELECT instance_id, count(*) FROM calls WHERE run = %s GROUP BY 1", (run,)).fetchall())
    assert calls == dict.fromkeys(plays, 3)  # every call one row: the S3 ledger copies filled in what was dropped
    assert loop.resolved == {"copy": 1, "lost": 2}
    resources.remove_queues(res)
    aws.client("sqs").delete_queue(QueueUrl=sink)


class ExitedLauncher:
    """Tasks that have already exited with the given codes."""

    def __init__(self, codes: dict[str, int]):
        self.codes = codes

    def poll(self, handle: TaskHandle) -> int | None:
        return self.codes[handle.ref.instance_id]

    def exit_reason(self, handle: TaskHandle) -> str | None:
        return None  # none killed for memory


def test_the_bound_depends_on_the_done_mark_and_a_state_that_cannot_change_is_never_waited_on(
        tmp_path, unique, pg, valkey, moto_endpoint, run_keys):
    """The driver's side alone: a task that never marked its result sent is resolved after the grace; one that
    marked it after backend.result_wait_s, even after its mark has expired; each exactly once."""
    plan = opened(tmp_path, unique, pg, result_wait_s=300)
    run = plan.spec.run.name
    res = resources.ensure(run)
    crashed, finished, marked = (AttemptRef(run=run, instance_id=i, attempt=1) for i in (
        "evalplane__calc-1", "evalplane__calc-2", "evalplane__textkit-1"))
    launcher = ExitedLauncher({crashed.instance_id: -9, finished.instance_id: 0, marked.instance_id: 1})
    for ref in (finished, marked):
        valkey.hset(keys.progress(ref), mapping={"phase": "done"})
    loop = runmod.DriverLoop(plan, res, pg, valkey, launcher, None, None, run_keys)
    loop.landed = {}
    for ref in (crashed, finished, marked):
        loop.running[ref] = runmod.Running(handle=TaskHandle(ref=ref, task_id=ref.instance_id), started=0.0)

    def landed() -> dict[str, str]:
        got = dict(pg.execute("SELECT instance_id, error FROM attempts WHERE run = %s", (run,)).fetchall())
        pg.commit()
        return got

    loop._reap(loop.landed, now=100.0)  # exits seen
    loop._reap(loop.landed, now=100.0 + runmod.REAP_GRACE_S + 0.1)
    assert list(landed()) == [crashed.instance_id]
    valkey.delete(keys.progress(finished), keys.progress(marked))  # the marks expire: no matter, the bound holds
    loop._reap(loop.landed, now=99.0 + plan.spec.backend.result_wait_s)
    assert list(landed()) == [crashed.instance_id]  # within the bound, a result said to be sent is waited for
    loop._reap(loop.landed, now=101.0 + plan.spec.backend.result_wait_s)
    got = landed()
    assert set(got) == {crashed.instance_id, finished.instance_id, marked.instance_id}
    assert got[crashed.instance_id] == "task_died: exited with code -9 without sending its result"
    assert got[marked.instance_id].startswith("lost_result: the task sent its result and exited (code 1)")
    loop._reap(loop.landed, now=1000.0)  # landed: dropped from the loop, nothing landed twice
    assert not loop.running and loop.resolved == {"copy": 0, "lost": 3}
    resources.remove_queues(res)


def test_a_sent_result_is_not_called_lost_while_the_results_queue_holds_messages(
        tmp_path, unique, pg, valkey, moto_endpoint, run_keys):
    """The writers may be behind: while the results queue holds any message, a gone task that marked its result
    sent is waited for; its bound runs from when the queue was last seen holding one."""
    plan = opened(tmp_path, unique, pg, result_wait_s=300)
    run = plan.spec.run.name
    res = resources.ensure(run)
    ref = AttemptRef(run=run, instance_id="evalplane__calc-2", attempt=1)
    valkey.hset(keys.progress(ref), mapping={"phase": "done"})
    loop = runmod.DriverLoop(plan, res, pg, valkey, ExitedLauncher({ref.instance_id: 0}), None, None, run_keys)
    loop.landed = {}
    loop.running[ref] = runmod.Running(handle=TaskHandle(ref=ref, task_id=ref.instance_id), started=0.0)
    bound = plan.spec.backend.result_wait_s

    def errors() -> list:
        got = [e for (e,) in pg.execute("SELECT error FROM attempts WHERE run = %s", (run,)).fetchall()]
        pg.commit()
        return got

    aws.send(res.results_queue_url, "a result the writers have not reached yet")
    loop._reap(loop.landed, now=100.0)  # exit seen
    loop._reap(loop.landed, now=101.0 + bound)  # past its bound, but the queue holds a message
    assert errors() == []
    sqs = aws.client("sqs")
    for m in sqs.receive_message(QueueUrl=res.results_queue_url, MaxNumberOfMessages=10)["Messages"]:
        sqs.delete_message(QueueUrl=res.results_queue_url, ReceiptHandle=m["ReceiptHandle"])
    loop._reap(loop.landed, now=100.0 + 2 * bound)  # the queue is empty, but was busy less than a bound ago
    assert errors() == []
    loop._reap(loop.landed, now=102.0 + 2 * bound)
    got = errors()
    assert len(got) == 1 and got[0].startswith("lost_result: the task sent its result and exited (code 0)")
    resources.remove_queues(res)


def test_a_resumed_driver_lands_a_gone_tasks_s3_copy_instead_of_relaunching(plan, pg, valkey, database_url, run_keys):
    """An earlier driver's task (its progress key alive) is waited for; once the key is gone and no row came, its
    S3 result copy lands; one that left none is launched again."""
    run = plan.spec.run.name
    res = resources.ensure(run)
    kept, lost = (AttemptRef(run=run, instance_id=i, attempt=1) for i in ("evalplane__calc-1", "evalplane__calc-2"))
    rows = ledger(kept, 2)
    aws.put_text(aws.result_copy_uri(res.artifacts_prefix(kept)),  # as send_result stores it: the tail rides along
                 Envelope(msg=result(kept, rows).model_copy(update={"ledger": rows})).model_dump_json(),
                 sign=run_keys.attempt_signer(kept))
    loop = runmod.DriverLoop(plan, res, pg, valkey, None, None, None, run_keys)
    loop.landed, loop.waiting = {}, {kept, lost}
    loop._recheck_waiting()  # no progress keys: both tasks are gone
    assert not loop.waiting and loop.landed == {(kept.instance_id, 1): "EMPTY_PATCH"}
    assert [r.instance_id for r in loop._pending(loop.landed)][:1] == [lost.instance_id]
    assert pg.execute("SELECT count(*) FROM calls WHERE run = %s", (run,)).fetchone()[0] == 2
    resources.remove_queues(res)


def test_a_s3_copy_the_database_refuses_lands_as_lost(plan, pg, database_url, run_keys):
    """A copy whose row the database refuses (patch_bytes beyond its integer column) lands as lost rather than
    keeping the run open, with its ledger copy's rows."""
    run = plan.spec.run.name
    res = resources.ensure(run)
    ref = AttemptRef(run=run, instance_id="evalplane__calc-1", attempt=1)
    rows = ledger(ref, 2)
    sign = run_keys.attempt_signer(ref)
    aws.put_text(aws.ledger_copy_uri(res.artifacts_prefix(ref)), "".join(r.model_dump_json() + "\n" for r in rows),
                 sign=sign)
    aws.put_text(aws.result_copy_uri(res.artifacts_prefix(ref)), Envelope(
        msg=result(ref, rows).model_copy(update={"patch_bytes": 2**40})).model_dump_json(), sign=sign)
    writer = ResultsWriter(res, database_url, keys=run_keys)
    how = writer.land_unreported(ref, lambda rows: runmod.unreported_result(plan, ref, "lost_result: test", rows))
    assert how == "lost"
    assert pg.execute("SELECT status, error, calls FROM attempts WHERE run = %s", (run,)).fetchall() == [
        ("INFRA_ERROR", "lost_result: test", 2)]
    assert pg.execute("SELECT count(*) FROM calls WHERE run = %s", (run,)).fetchone()[0] == 2
    resources.remove_queues(res)
