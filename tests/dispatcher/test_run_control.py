"""Live control of a run (issue 35): pause and resume, resize, and retry, on the driver loop itself.

Tasks are threads playing a task's end (tests/dispatcher/test_reaper.py's), held at a gate until the test lets them
finish, so what the loop launches while they run is seen exactly; rows land through a real ResultsWriter.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from contract import aws, keys
from contract.models import SPOT_INTERRUPTED, AttemptRef, HarnessOutcome
from dispatcher import report, store
from dispatcher.backends import resources
from dispatcher.driver import loop as runmod
from dispatcher.driver.writer import ResultsWriter
from dispatcher.launchers.base import Launcher, TaskHandle
from dispatcher.plan import make_plan
from dispatcher.report import figures
from dispatcher.retry import pick
from dispatcher.spec import load_spec
from harness import task
from shim.breaker import FAIL_LUA
from tests.dispatcher.test_reaper import ledger, result, spec_file

INFRA_PLAYS = {"setup": "setup failed: could not fetch the job's repository",
               "rate_limited": "rate_limited: the upstream refused calls past the shim's retries"}


def make(tmp_path: Path, run: str, pg, attempts: int = 1, concurrency: int = 5):
    plan = make_plan(load_spec(spec_file(tmp_path, run, 2, attempts=attempts, concurrency=concurrency, pool=run)))
    runmod.open_run(pg, plan)
    return plan


class GatedTasks(Launcher):
    """Each task a thread that waits at `gate`, then plays its end as a task does: its ledger, its result (or, as
    `plays` says per (instance, attempt): a set-up failure, rate_limited, a result lost on its way), its done mark."""

    def __init__(self, res, valkey, run_keys, sink: str, plays: dict[tuple[str, int], str] | None = None):
        self.res, self.valkey, self.run_keys, self.sink = res, valkey, run_keys, sink
        self.plays = plays or {}
        self.gate = threading.Event()
        self.threads: dict[str, threading.Thread] = {}
        self.launched: list[AttemptRef] = []

    def _task(self, ref: AttemptRef) -> None:
        self.gate.wait(60)
        play, rows = self.plays.get((ref.instance_id, ref.attempt), "normal"), ledger(ref, 2)
        sign = self.run_keys.attempt_signer(ref)
        msg = result(ref, rows)
        if play in INFRA_PLAYS:
            msg = msg.model_copy(update={"outcome": HarnessOutcome.INFRA_ERROR, "error": INFRA_PLAYS[play]})
        queue = self.sink if play == "drop" else self.res.results_queue_url  # "drop": killed on its way, no copy
        task.send_result(queue, msg, rows, None, sign)
        self.valkey.hset(keys.progress(ref), mapping={"phase": "done"})
        self.valkey.expire(keys.progress(ref), 600)

    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        t = self.threads[ref.slug] = threading.Thread(target=self._task, args=(ref,), daemon=True)
        t.start()
        self.launched.append(ref)
        return TaskHandle(ref=ref, task_id=ref.slug)

    def poll(self, handle: TaskHandle) -> int | None:
        return None if self.threads[handle.task_id].is_alive() else 0

    def stop(self, handle: TaskHandle) -> None:
        pass

    def alive(self) -> int:
        return sum(t.is_alive() for t in self.threads.values())


@pytest.fixture
def world(tmp_path, unique, pg, valkey, database_url, moto_endpoint, run_keys, monkeypatch):
    """(make a plan, its resources, tasks, a loop over them) with a results writer landing rows meanwhile."""
    monkeypatch.setattr(runmod, "REAP_GRACE_S", 0.5)
    made: dict = {}

    def setup(plays=None, **kw):
        plan = make(tmp_path, unique, pg, **kw)
        res = resources.ensure(unique)
        sink = aws.client("sqs").create_queue(QueueName=f"{unique}-sink")["QueueUrl"]
        tasks = GatedTasks(res, valkey, run_keys, sink, plays)
        writer = ResultsWriter(res, database_url, keys=run_keys)
        stop = threading.Event()
        consumer = threading.Thread(target=writer.run_until, args=(stop,), daemon=True)
        consumer.start()
        made.update(res=res, stop=stop, consumer=consumer, sink=sink)
        return plan, res, tasks

    yield setup
    if made:
        made["stop"].set()
        made["consumer"].join(10)
        resources.remove_queues(made["res"])
        aws.client("sqs").delete_queue(QueueUrl=made["sink"])


def new_loop(plan, res, pg, valkey, tasks, run_keys, pacer=None):
    return runmod.DriverLoop(plan, res, pg, valkey, tasks, pacer,
                             lambda ref: runmod.make_job(plan, res, ref, "http://u.invalid", "redis://v.invalid"),
                             run_keys)


def landed(pg, run: str) -> dict[tuple[str, int], str]:
    got = {(i, a): s for i, a, s in pg.execute("SELECT instance_id, attempt, status FROM attempts WHERE run = %s",
                                               (run,)).fetchall()}
    pg.commit()
    return got


def step_until(loop, done, timeout_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        loop.step()
        time.sleep(0.1)


def run_to_end(loop, timeout_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while not loop.step():
        assert time.monotonic() - t0 < timeout_s, "the run did not end"
        time.sleep(0.1)


def test_a_paused_run_launches_nothing_its_running_attempts_land_and_a_new_driver_stays_paused(
        world, pg, valkey, run_keys):
    plan, res, tasks = world()
    run = plan.spec.run.name
    loop = new_loop(plan, res, pg, valkey, tasks, run_keys)
    loop._next_plan, loop.target = float("inf"), 2  # no pacer here: the fleet size is set
    loop.step()
    assert len(tasks.launched) == 2
    assert store.set_paused(pg, run, True)
    pg.commit()
    tasks.gate.set()  # the two running at the pause finish
    step_until(loop, lambda: len(landed(pg, run)) == 2)
    for _ in range(5):
        loop.step()
    assert len(tasks.launched) == 2 and not loop.running  # they landed; nothing new started
    assert loop.paused

    # the driver is killed; a new one (resume) on the paused run stays paused
    again = new_loop(plan, res, pg, valkey, tasks, run_keys)
    again._next_plan, again.target = float("inf"), 2
    for _ in range(5):
        again.step()
    assert len(tasks.launched) == 2
    [progress] = store.progress(pg, run)
    assert progress.paused and progress.landed == 2

    assert store.set_paused(pg, run, False)
    pg.commit()
    run_to_end(again)  # resumed: the rest launch and the run ends
    assert len(tasks.launched) == 5 and len(landed(pg, run)) == 5


class Pacer:
    """The PoolPacer's answer without Ray: no limits known (the planner then works under its ceiling)."""

    class tick:  # the actor method's name: pacer.tick.remote()
        @staticmethod
        def remote():
            return {"limits": {}}


def test_resize_changes_the_running_tasks_within_one_planner_pass(world, pg, valkey, run_keys, monkeypatch):
    monkeypatch.setattr(runmod.ray, "get", lambda x: x)
    plan, res, tasks = world(attempts=2, concurrency=8)  # 10 attempts
    run = plan.spec.run.name
    loop = new_loop(plan, res, pg, valkey, tasks, run_keys, Pacer())
    assert store.resize(pg, run, 2)
    pg.commit()
    loop.step()
    assert tasks.alive() == 2
    assert store.resize(pg, run, 5)
    pg.commit()
    loop.step()  # one pass: the ceiling read, the fleet planned under it, launched up to it
    assert tasks.alive() == 5 and loop.target == 5
    assert store.resize(pg, run, 1)
    pg.commit()
    loop.step()
    assert loop.target == 1 and len(tasks.launched) == 5  # above the ceiling: nothing new
    tasks.gate.set()
    most = 0
    t0 = time.monotonic()
    while not loop.step():
        assert time.monotonic() - t0 < 60, "the run did not end"
        if len(landed(pg, run)) >= 5:  # the five that ran at the resize have gone: one at a time from here
            most = max(most, sum(1 for t in loop.running.values() if t.exit_code is None))
        time.sleep(0.05)
    assert most == 1 and len(landed(pg, run)) == 10
    [progress] = store.progress(pg, run)
    assert progress.concurrency == 1


def test_retry_relaunches_exactly_the_infra_failures_and_the_official_report_counts_the_retries(
        world, pg, valkey, run_keys, tmp_path):
    plays = {("evalplane__calc-2", 1): "drop", ("evalplane__textkit-1", 1): "setup",
             ("evalplane__textkit-2", 1): "rate_limited"}
    plan, res, tasks = world(plays=plays)
    run = plan.spec.run.name
    tasks.gate.set()
    loop = new_loop(plan, res, pg, valkey, tasks, run_keys)
    loop._next_plan, loop.target = float("inf"), 5
    run_to_end(loop)
    assert {i for (i, _), s in landed(pg, run).items() if s == "INFRA_ERROR"} == {i for i, _ in plays}

    def official(out: Path) -> dict:
        attempts = report.fetch_attempts(pg, run)
        [_, report_file] = report.write_outputs(run, attempts, list(plan.rows.values()), out, 1,
                                                lambda iid, n: res.artifacts_prefix(
                                                    AttemptRef(run=run, instance_id=iid, attempt=n)))
        return json.loads(report_file.read_text())

    before = official(tmp_path / "before")
    assert before["infra_failure_ids"] == sorted(i for i, _ in plays)
    assert {before["failure_reasons"][i] for i, _ in plays} == {"lost_result", "setup_failed", "rate_limited"}

    picks, left_out = pick(store.current_attempts(pg, run), {"infra_error"}, 1.0, None)
    assert sorted(p[3] for p in picks) == ["lost_result", "rate_limited", "setup_failed"] and left_out == 0
    new = store.add_retries(pg, run, picks)
    pg.commit()
    assert sorted(new) == sorted((i, 2) for i, _ in plays)  # new attempt numbers, past the run's own
    # asked again before they land: nothing more (their retries are pending)
    assert pick(store.current_attempts(pg, run), {"infra_error"}, 1.0, None)[0] == []

    # the driver started again (resume): the retries are its plan's too
    assert runmod.take_retries(pg, plan) == 3 and runmod.take_retries(pg, plan) == 0
    again = new_loop(plan, res, pg, valkey, tasks, run_keys)
    again._next_plan, again.target = float("inf"), 5
    run_to_end(again)
    assert sorted((r.instance_id, r.attempt) for r in tasks.launched[5:]) == sorted(new)  # exactly those

    after = official(tmp_path / "after")
    assert after.get("infra_failure_ids", []) == [] and after["submitted_instances"] == 5
    rows = report.fetch_attempts(pg, run)
    assert len(rows) == 8
    superseded = {(r["instance_id"], r["attempt"]) for r in rows if r["superseded"]}
    assert superseded == {(i, 1) for i, _ in plays}
    assert {r["slot"] for r in rows} == {1}
    figs, _ = figures.load(pg, run)
    assert [i.attempts for i in figs.instances_detail] == [1] * 5  # pass@k counts slots, not retries
    assert "INFRA_ERROR" not in figs.statuses


def test_a_running_driver_takes_on_a_retry(world, pg, valkey, run_keys):
    """retry on a run whose driver is running: the driver takes it into its plan and launches it."""
    plays = {("evalplane__calc-1", 1): "setup", ("evalplane__calc-2", 1): "drop"}  # the drop keeps the run open 2 s
    plan, res, tasks = world(plays=plays)
    run = plan.spec.run.name
    tasks.gate.set()
    loop = new_loop(plan, res, pg, valkey, tasks, run_keys)
    loop._next_plan, loop.target = float("inf"), 5
    step_until(loop, lambda: landed(pg, run).get(("evalplane__calc-1", 1)) == "INFRA_ERROR")
    picks, _ = pick(store.current_attempts(pg, run), {"setup_failed"}, 1.0, None)
    assert store.add_retries(pg, run, picks) == [("evalplane__calc-1", 2)]
    pg.commit()
    step_until(loop, lambda: len(tasks.launched) == 6)  # once the fleet has room (a task counts until its row lands)
    assert tasks.launched[-1] == AttemptRef(run=run, instance_id="evalplane__calc-1", attempt=2)
    run_to_end(loop)
    assert landed(pg, run)[("evalplane__calc-1", 2)] == "EMPTY_PATCH" and len(landed(pg, run)) == 6


class SpotLauncher:
    """Tasks that have exited, each taken back by Spot (ECS's stop code SpotInterruption) before sending a result."""

    def poll(self, handle: TaskHandle) -> int | None:
        return 143

    def exit_reason(self, handle: TaskHandle) -> str | None:
        return SPOT_INTERRUPTED


def test_a_spot_interrupted_attempt_lands_infra_error_with_its_partial_ledger_and_is_relaunched_once(
        world, pg, valkey, run_keys):
    plan, res, _ = world()
    run = plan.spec.run.name
    loop = new_loop(plan, res, pg, valkey, SpotLauncher(), run_keys)
    loop.landed = {}

    def interrupted(ref: AttemptRef, at: float) -> None:
        rows = ledger(ref, 2)  # the calls it made before the interruption, in its S3 ledger copy
        aws.put_text(aws.ledger_copy_uri(res.artifacts_prefix(ref)), "".join(r.model_dump_json() + "\n" for r in rows),
                     sign=run_keys.attempt_signer(ref))
        loop.running[ref] = runmod.Running(handle=TaskHandle(ref=ref, task_id=ref.slug, capacity="spot"), started=at)
        loop._reap(loop.landed, now=at)  # its exit seen
        loop._reap(loop.landed, now=at + runmod.REAP_GRACE_S + 0.1)  # gone without a result: landed by the driver
        loop._reap(loop.landed, now=at + runmod.REAP_GRACE_S + 0.2)  # landed and gone: followed no more
        assert ref not in loop.running

    first = AttemptRef(run=run, instance_id="evalplane__calc-1", attempt=1)
    interrupted(first, 100.0)
    row = pg.execute("SELECT status, error, calls, task_capacity FROM attempts WHERE run = %s", (run,)).fetchone()
    assert row[0] == "INFRA_ERROR" and row[1].startswith("spot_interrupted: ") and row[2] == 2
    assert row[3] == "spot"  # the capacity its task ran on, which prices it
    assert store.retried(pg, run) == [("evalplane__calc-1", 2)]
    loop._control(200.0)  # the next pass takes it on
    assert plan.refs[-1] == AttemptRef(run=run, instance_id="evalplane__calc-1", attempt=2)

    interrupted(plan.refs[-1], 300.0)  # the relaunch is interrupted too: not relaunched again (once)
    pg.commit()
    assert store.retried(pg, run) == [("evalplane__calc-1", 2)]
    assert [(r["attempt"], r["slot"], r["superseded"]) for r in report.fetch_attempts(pg, run)] == [
        (1, 1, True), (2, 1, False)]


def test_a_pause_holding_calls_reaches_the_shims_key_moves_the_wall_time_guard_on_and_outlives_valkey(
        world, pg, valkey, run_keys):
    plan, res, tasks = world()
    run, wall = plan.spec.run.name, plan.spec.budget.wall_time_s
    loop = new_loop(plan, res, pg, valkey, tasks, run_keys)
    loop._next_plan, loop.target = float("inf"), 2
    loop.step()
    assert len(tasks.launched) == 2
    assert store.set_paused(pg, run, True, hold_calls=True, valkey=valkey)
    pg.commit()
    assert valkey.exists(keys.run_hold(run))  # the shims' key, set with the row
    for _ in range(5):
        loop.step()
        time.sleep(0.05)
    assert loop.hold_calls and len(tasks.launched) == 2
    assert loop.held_total_s > 0.1  # the wall-time guard's allowance grows while calls are held
    t = loop.running[tasks.launched[0]]
    loop._reap(loop.landed, now=t.started + wall + runmod.STOP_GRACE_S + loop.held_total_s - 0.05)
    assert t.stopped_at is None  # past wall time and grace, but not past them and the held time

    valkey.delete(keys.run_hold(run))  # Valkey restarted without it: a driver starting again restores it
    assert store.sync_hold(pg, valkey, run)
    pg.commit()
    assert valkey.exists(keys.run_hold(run))
    assert store.set_paused(pg, run, False, valkey=valkey)  # resume lifts the hold with the pause
    pg.commit()
    assert not valkey.exists(keys.run_hold(run)) and store.control(pg, run).hold_calls is False
    pg.commit()
    tasks.gate.set()
    run_to_end(loop)
    assert len(landed(pg, run)) == 5 and not loop.hold_calls


def test_an_open_outage_breaker_stops_launching_until_it_closes(world, pg, valkey, run_keys):
    plan, res, tasks = world()
    breaker = keys.pool_breaker(plan.spec.pool)
    valkey.register_script(FAIL_LUA)(keys=[breaker], args=[1, 0, 1000])  # one failure trips it (threshold 1)
    loop = new_loop(plan, res, pg, valkey, tasks, run_keys)
    loop._next_plan, loop.target = float("inf"), 2
    try:
        for _ in range(5):
            loop.step()
            time.sleep(0.05)
        assert tasks.launched == [] and loop.outage_s is not None
        assert loop.held_total_s > 0.1  # the wall-time guard's allowance grows while it is open
        valkey.delete(breaker)  # a probe succeeded
        loop.step()
        assert len(tasks.launched) == 2 and loop.outage_s is None
        tasks.gate.set()
        run_to_end(loop)
        assert len(landed(pg, plan.spec.run.name)) == 5
    finally:
        valkey.delete(breaker)
