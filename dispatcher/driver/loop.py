"""The dispatcher's main loop as a Ray driver: jobs to S3, one task per attempt, rows landed, run closed.

spec -> Plan -> (job document, task) per attempt -> results queue -> ResultsWriter -> rows -> report.
Resumable: attempts that already have a row are never relaunched, and attempts whose task is still
alive (its progress key in Valkey is fresh) are waited for, not launched twice.

The run always ends: every attempt's row lands from what its task sent, or, once its task is gone and the row has
not landed within a bound, from what its task left in S3 (its result's copy, else an infra_error lost_result with
its ledger copy's rows), landed by the driver itself (`_resolve`). Grading too: a patch whose verdict does not come
within eval.verdict_wait_s of the last sign that a grader may still hold its job, or whose eval job went to the
dead-letter queue, lands as infra_error (verdict_lost) (`_await_verdicts`). Nothing the loop waits on is a state
that cannot change.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psycopg
import ray
import redis
from botocore.exceptions import ClientError
from psycopg.types.json import Jsonb

from contract import aws, db, keys, valkey_auth
from contract.models import (
    SPOT_INTERRUPTED,
    AttemptLimits,
    AttemptRef,
    AttemptResult,
    CallRecord,
    Envelope,
    EvalJob,
    HarnessOutcome,
    HarnessRef,
    Job,
    ModelRef,
    Totals,
    utcnow,
)
from contract.signing import RunKeys
from dispatcher import backends, store
from dispatcher.backends import daemons, resources
from dispatcher.backends.base import attempt_env
from dispatcher.backends.resources import RunResources
from dispatcher.dashboard.live import start_live
from dispatcher.driver.actors import PoolPacer, ResultsWriterActor
from dispatcher.driver.fleet import Planner, observe
from dispatcher.driver.progress import Progress
from dispatcher.driver.writer import ResultsWriter
from dispatcher.launchers.base import LaunchContext, Launcher, TaskHandle
from dispatcher.plan import Plan
from plumbing.services import free_port
from shim.breaker import open_for_s
from shim.caps import KEY_TTL_S

log = logging.getLogger("evalplane.dispatcher")

REAP_GRACE_S = 20.0  # a task gone without marking its result sent is resolved after this (backend.result_wait_s if it did)
STOP_GRACE_S = 120.0  # past its wall-time limit by this, a task is stopped from outside
RETRY_RESOLVE_S = 10.0  # a resolution that failed (S3 or the database unreachable) is tried again after this
VERDICT_CHECK_S = 5.0  # how often the driver looks at grading while patches wait for verdicts
PASS_BUDGET_S = 0.5  # launching and resolving stop for the pass after this long (the rest go next pass)
LAUNCH_CHUNK = 64  # job documents written (in parallel) and tasks launched per step within a pass


class RunConflict(Exception):
    """The run name exists with a different spec."""


@dataclass
class Running:
    handle: TaskHandle
    started: float
    exited_at: float | None = None
    exit_code: int | None = None
    stopped_at: float | None = None  # when the driver stopped it (its wall-time guard failed)
    held_at: float = 0.0  # the run's time with calls held (DriverLoop.held_total_s) when it started
    result_sent: bool = False  # the task marked its progress key "done": its result is on the queue
    resolve_at: float | None = None  # once its task is gone: when the driver lands its row if none has landed


def open_run(conn: psycopg.Connection, plan: Plan) -> str:
    """Insert the run row, or find it: returns 'new', 'resume' or 'finished'."""
    spec = plan.spec
    row = conn.execute("SELECT spec_hash, status FROM runs WHERE run = %s", (spec.run.name,)).fetchone()
    if row is None:
        conn.execute(
            "INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, %s, %s, %s)",
            (spec.run.name, Jsonb(spec.model_dump(mode="json")), plan.spec_hash, spec.backend.kind, len(plan.refs)),
        )
        conn.commit()
        return "new"
    if row[0] != plan.spec_hash:
        raise RunConflict(
            f"run {spec.run.name!r} already exists with a different spec; choose another run.name"
        )
    return "finished" if row[1] == "finished" else "resume"


def landed_status(conn: psycopg.Connection, run: str) -> dict[tuple[str, int], str]:
    rows = conn.execute("SELECT instance_id, attempt, status FROM attempts WHERE run = %s", (run,)).fetchall()
    conn.commit()
    return {(i, a): s for i, a, s in rows}


def make_job(plan: Plan, res: RunResources, ref: AttemptRef, upstream_url: str, valkey_url: str,
             alias: str | None = None) -> Job:
    spec = plan.spec
    return Job(
        ref=ref,
        harness=HarnessRef(name=spec.harness.name, settings=spec.harness.settings | {"max_tokens": spec.model.max_tokens}),
        model=ModelRef(provider=spec.model.provider, model=spec.model.model, pool=spec.pool, alias=alias),
        limits=AttemptLimits(cost_usd=spec.budget.attempt_usd, max_turns=spec.budget.max_turns,
                             wall_time_s=spec.budget.wall_time_s, outage_bound_s=spec.budget.outage_bound_s),
        run_cost_usd=spec.budget.run_usd,
        instance=plan.rows[ref.instance_id],
        repo_source=plan.repo_sources[ref.instance_id],
        bundle=plan.bundles.get(ref.instance_id),
        upstream_url=upstream_url,
        results_queue_url=res.results_queue_url,
        artifacts_prefix=res.artifacts_prefix(ref),
        valkey_url=valkey_url,
        resources=spec.backend.resources,
    )


def land_attempt(res: RunResources, plan: Plan, ref: AttemptRef, outcome: HarnessOutcome, why: str,
                 run_keys: RunKeys) -> None:
    """Land an attempt that no task will report on (exactly one row, through the writer like any other, signed
    with the attempt's key as its task would)."""
    now = utcnow()
    msg = AttemptResult(
        ref=ref, harness=plan.spec.harness.name, pool=plan.spec.pool, model=plan.spec.model.model,
        outcome=outcome, started_at=now, ended_at=now, error=why, resources=plan.spec.backend.resources,
    )
    aws.send(res.results_queue_url, Envelope(msg=msg).model_dump_json(), sign=run_keys.attempt_signer(ref))


def unreported_result(plan: Plan, ref: AttemptRef, why: str, rows: list[dict]) -> AttemptResult:
    """The infra_error an attempt lands as when its task is gone and left no result: its totals are those of the
    ledger rows its task's S3 copy holds (landed with it), so its spend is not lost with it."""
    now = utcnow()
    try:
        records = [CallRecord.model_validate(r) for r in rows]
    except ValueError:
        records = []
    return AttemptResult(
        ref=ref, harness=plan.spec.harness.name, pool=plan.spec.pool, model=plan.spec.model.model,
        outcome=HarnessOutcome.INFRA_ERROR, ledger_calls=len(records), totals=Totals.of(records),
        started_at=min((r.started_at for r in records), default=now), ended_at=now, error=why,
        resources=plan.spec.backend.resources,
    )


def execute(plan: Plan, valkey_url: str, console=None) -> str:
    """Run (or resume) the plan to the end. Returns 'finished' (or the earlier state if nothing was left).

    Everything that differs between where runs happen is asked of the spec's backend (dispatcher.backends): its
    queues and keys, its Valkey, the upstream, its launcher, its eval workers."""
    spec = plan.spec
    run = spec.run.name
    conn = db.connect()
    db.migrate(conn)
    state = open_run(conn, plan)
    if state == "finished":
        return state
    take_retries(conn, plan)

    backend = backends.for_spec(spec)
    res = backend.run_resources()
    # The run secret (attempt keys derive from it) and the verdict key: 0600 files the writers read; never a task's.
    key_files = backend.key_files()
    run_keys = RunKeys.load(*key_files)
    valkey_url = backend.valkey_url(valkey_url)
    valkey_admin = redis.Redis.from_url(valkey_url)
    carry_run_spend(valkey_admin, run, store.spent_usd(conn, run))
    store.sync_hold(conn, valkey_admin, run)  # a stored `pause --hold-calls` holds whatever Valkey kept
    conn.commit()
    aws_env = backend.aws_env()
    try:
        upstream, key = backend.upstream(plan)
        alias = None
        if spec.gateway:  # tasks then call the gateway with the run's key; the provider key stays with the gateway
            gw = backend.open_gateway(plan, conn, valkey_url, run_keys, upstream, key)
            upstream, key, alias = gw.url, gw.key, gw.alias
        launcher = backend.make_launcher(LaunchContext(
            plan=plan, backend=backend, run_dir=backend.run_dir, state_dir=daemons.state_dir(),
            upstream_url=upstream, upstream_key=key, valkey_url=valkey_auth.without_credentials(valkey_url),
            valkey_user=backend.task_valkey_user(valkey_admin, valkey_url, run_keys), aws_env=aws_env,
            attempt_env=attempt_env(run_keys)))
        backend.start_eval_workers(res, run_keys)

        ray_init(spec.backend.dashboard, aws_env)
        writers = [ResultsWriterActor.options(name=f"results-writer:{run}:{i}", namespace="evalplane",
                                              get_if_exists=True).remote(
            res.model_dump(), db.database_url(), aws_env, spec.eval.timeout_s, key_files)
            for i in range(spec.backend.writer_count)]
        pacer = PoolPacer.options(name=f"pacer:{spec.pool}", namespace="evalplane", get_if_exists=True).remote(
            spec.pool, valkey_url, {"rpm": spec.model.rpm, "itpm": spec.model.itpm, "otpm": spec.model.otpm})
        ray.get(pacer.tick.remote())

        task_upstream = launcher.task_url(upstream)
        # job documents hold no credential
        task_valkey = launcher.task_url(valkey_auth.without_credentials(valkey_url))
        loop = DriverLoop(plan, res, conn, valkey_admin, launcher, pacer,
                          lambda ref: make_job(plan, res, ref, task_upstream, task_valkey, alias), run_keys)
        # The live view (issue 27): the dashboard's keys, and the dashboard itself with backend.dashboard = true.
        progress = Progress(console, run, len(plan.refs),
                            live=start_live(valkey_admin, plan, loop, valkey_url, console))
        while not loop.step(progress):
            backend.check_eval_workers()
            time.sleep(0.05 if loop.launch_backlog else 0.5)  # launches left for the next pass: no pause
        progress.done(loop.launch_report(), loop.resolved)
        loop.resolver.close()
        ray.get([w.stop.remote() for w in writers])
        for w in writers:
            ray.kill(w)
        store.finish(conn, run)
        if spec.gateway:
            backend.close_gateway(conn, valkey_admin)
        backend.finish(valkey_admin)
        resources.remove_queues(res)
        remove_run_keys(valkey_admin, run)
        return "finished"
    finally:
        backend.stop_eval_workers()
        if spec.gateway:  # finished, cancelled or failed: the run's key is refused from now on (a resume mints it)
            try:
                conn.rollback()
                backend.close_gateway(conn, valkey_admin)
            except Exception:
                log.exception("could not revoke the gateway key of run %s", run)
        conn.close()


class DriverLoop:
    """One pass at a time: land-check, reap, cancel, size the fleet, launch. Returns True when all landed."""

    PLAN_EVERY_S = 5.0

    def __init__(self, plan: Plan, res: RunResources, conn, valkey, launcher: Launcher, pacer, make_job_doc,
                 run_keys: RunKeys):
        self.plan, self.res, self.conn, self.valkey = plan, res, conn, valkey
        self.launcher, self.pacer, self.make_job_doc = launcher, pacer, make_job_doc
        self.run_keys = run_keys
        # lands what no task will report on (its own connection: the loop's reads stay short transactions)
        self.resolver = ResultsWriter(res, db.database_url(), plan.spec.eval.timeout_s, keys=run_keys)
        self.resolved = {"copy": 0, "lost": 0}  # attempts landed by _resolve, by what they landed from
        self.running: dict[AttemptRef, Running] = {}
        self.planner = Planner(plan.spec.backend.concurrency)
        self.target = min(4, plan.spec.backend.concurrency)  # then grown by the planner while pacer wait is low
        self.limits: dict[str, int] = {}
        self.observed = None  # the pool's last observation (fleet.observe), as the planner sized the fleet from it
        self._next_plan = 0.0
        self.cancel_sent: set[AttemptRef] = set()
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="jobdocs")
        self._cursor = 0
        self.busy_s = {"land check": 0.0, "reap": 0.0, "plan": 0.0, "job documents": 0.0, "launch": 0.0}
        self.landed: dict[tuple[str, int], str] | None = None  # (instance_id, attempt) -> status; see _refresh
        self.waiting: set[AttemptRef] = set()  # attempts an earlier dispatcher's task still holds (resume)
        self.launch_backlog = False  # the last pass stopped launching at its time budget, with room left
        self.counts: dict[str, int] = {}  # the run's rows per status, as of the last pass
        # grading: when the eval queue last held a job (waiting, or held by a grader; a new driver assumes now),
        # the attempts whose eval job went to the dead-letter queue (and when seen), the next look
        self.eval_busy_at = time.monotonic()
        self.results_busy_at = float("-inf")  # when the results queue was last seen holding a message
        self.dead_jobs: dict[AttemptRef, float] = {}
        self._next_verdict_check = 0.0
        self.verdicts_lost = 0
        self.paused = False  # as the run's control state said at the last pass
        self.hold_calls = False  # ... and whether the shims hold new calls (`pause --hold-calls`)
        self.outage_s: float | None = None  # how long the pool's outage breaker has been open, None: closed
        # the time the breaker was seen open or the run's calls held, for the wall-time guard (the shims held
        # the tasks' calls then, and their wall time did not run)
        self.held_total_s = 0.0
        self._held_seen_at: float | None = None
        self.retries = len(plan.refs) - len(plan.rows) * plan.spec.run.attempts  # retry's attempts in the plan

    def step(self, progress: Progress | None = None) -> bool:
        t0 = time.monotonic()
        counts = self.counts = self._refresh()
        if progress:
            launches = self.launch_report()
            if self.paused:
                held = " (calls held)" if self.hold_calls else ""
                launches = "; ".join(filter(None, [f"paused{held}: launching nothing new", launches]))
            if self.outage_s is not None:
                launches = "; ".join(filter(None, [
                    f"provider outage for {self.outage_s:.0f} s: launching nothing new", launches]))
            progress.update(counts, self.running, launches)
        if sum(n for s, n in counts.items() if s != "PATCH_READY") == len(self.plan.refs):
            return True
        landed = self.landed
        now = time.monotonic()
        self.busy_s["land check"] += now - t0
        self.launcher.retry_pending()  # ECS: attempts not placed yet (capacity), when they are due
        self._reap(landed, now)
        if counts.get("PATCH_READY") and now >= self._next_verdict_check:
            self._next_verdict_check = now + VERDICT_CHECK_S
            try:
                self._await_verdicts(now)
            except Exception:  # SQS or the database unreachable: the next look
                log.exception("could not check on grading")
        control = self._control(now)
        if control.status == "cancelled":
            self._cancel(landed)
            return False
        t1 = time.monotonic()
        self.busy_s["reap"] += t1 - now
        if now >= self._next_plan:
            self._resize(landed)
            self._next_plan = now + self.PLAN_EVERY_S
        self.busy_s["plan"] += time.monotonic() - t1
        self._holds(now)
        if not control.paused and self.outage_s is None:  # running tasks go on (held in an outage); nothing new starts
            self._launch(landed, now)
        return False

    @property
    def ceiling(self) -> int:
        return self.planner.max_concurrency

    def _control(self, now: float) -> store.Control:
        """The run's control state as its operators set it, read every pass: a new ceiling is planned under at once
        (the target cut to it now, grown to it by this pass's planning), and attempts `retry` added are taken on."""
        control = store.control(self.conn, self.plan.spec.run.name)
        self.conn.commit()
        self.paused, self.hold_calls = control.paused, control.hold_calls
        ceiling = control.concurrency or self.plan.spec.backend.concurrency
        if ceiling != self.planner.max_concurrency:
            self.planner.max_concurrency = ceiling
            self.target = min(self.target, ceiling)
            self._next_plan = now
        if control.retries > self.retries:
            self.retries += take_retries(self.conn, self.plan)
        return control

    def _holds(self, now: float) -> None:
        """Read the pool's outage breaker (shim/breaker.py): while it is open nothing is launched. While it is, or
        the run's calls are held (`pause --hold-calls`, read by _control), the shims hold the running tasks' calls,
        and a task's wall-time guard is moved on by that time."""
        try:
            self.outage_s = open_for_s(self.valkey, self.plan.spec.pool)
        except Exception as e:  # noqa: BLE001 - Valkey unreachable: launching stops elsewhere if it matters
            log.warning("could not read the pool's outage breaker: %s", type(e).__name__)
            self.outage_s = None
        holding = self.outage_s is not None or self.hold_calls
        if holding and self._held_seen_at is not None:
            self.held_total_s += now - self._held_seen_at
        self._held_seen_at = now if holding else None

    def _refresh(self) -> dict[str, int]:
        """Bring `landed` up to date without rescanning the run: every row once, at the start; then, each pass,
        only the attempts whose row the loop waits for (its tasks that are gone, and those an earlier
        dispatcher's task still holds), since no other attempt's row matters to it (a live task's attempt is not
        launched again whatever its row). Returns the run's row count per status (an index-only count)."""
        run = self.plan.spec.run.name
        if self.landed is None:
            self.landed = landed_status(self.conn, run)
        tracked = {(r.instance_id, r.attempt) for r in self.waiting} | {
            (r.instance_id, r.attempt) for r, t in self.running.items() if t.exit_code is not None}
        if tracked:
            # `= ANY` costs alike under any plan (an index scan, or a scan with the array hashed); a join with the
            # tracked pairs did not: the statement is prepared, and its generic plan, made while the table was
            # empty, scanned every row for every tracked attempt (18 s a pass at 10,000 tasks and 15,000 rows).
            rows = self.conn.execute(
                "SELECT instance_id, attempt, status FROM attempts WHERE run = %s AND instance_id = ANY(%s)",
                (run, list({i for i, _ in tracked}))).fetchall()
            self.landed.update({(i, a): s for i, a, s in rows if (i, a) in tracked})
        if self.waiting:
            self._recheck_waiting()
        counts = dict(self.conn.execute(
            "SELECT status, count(*) FROM attempts WHERE run = %s GROUP BY status", (run,)).fetchall())
        self.conn.commit()
        return counts

    def _recheck_waiting(self) -> None:
        """An earlier dispatcher's task is waited for while its progress key lives; once the key is gone and no
        row landed, its result is landed from the task's S3 copy if it left one, else the attempt goes back to
        pending (its task died unheard, and it is launched again)."""
        refs = list(self.waiting)
        for ref, is_live in zip(refs, self._live(refs)):
            if (ref.instance_id, ref.attempt) in self.landed:
                self.waiting.discard(ref)
            elif not is_live:
                self.waiting.discard(ref)
                try:
                    self._land_unreported(ref, None)
                except Exception:  # S3 or the database unreachable: launched again instead
                    log.exception("could not look for the S3 result copy of %s", ref.slug)

    def _live(self, refs: list[AttemptRef]) -> list[bool]:
        """Whether each attempt's progress key exists (a task, ours or an earlier driver's, holds it)."""
        with self.valkey.pipeline(transaction=False) as p:
            for r in refs:
                p.exists(keys.progress(r))
            return [bool(n) for n in p.execute()]

    def _launch(self, landed: dict, now: float) -> None:
        """Up to the target: job documents first (written in parallel), then one task per attempt; a chunk at a
        time, stopping for this pass after PASS_BUDGET_S (and at the launcher's quota: launch_room)."""
        # A task counts until its row has landed: when results land slower than tasks finish (a slow writer,
        # a backed-up queue), launching stops instead of piling more results onto the queue.
        room = min(self.target - len(self.running), self.launcher.launch_room())
        batch: list[AttemptRef] = []
        for ref in self._pending(landed):
            if len(batch) >= room:
                break
            batch.append(ref)
        if not batch:
            return
        live = self._live(batch)
        self.waiting.update(r for r, is_live in zip(batch, live) if is_live)  # an earlier dispatcher's task
        batch = [r for r, is_live in zip(batch, live) if not is_live]
        deadline = time.monotonic() + PASS_BUDGET_S
        self.launch_backlog = False
        for i in range(0, len(batch), LAUNCH_CHUNK):
            chunk = batch[i:i + LAUNCH_CHUNK]
            t0 = time.monotonic()
            docs = [(self.res.job_uri(r), self.make_job_doc(r).model_dump_json()) for r in chunk]
            list(self.pool.map(lambda d: aws.put_text(*d), docs))
            t1 = time.monotonic()
            items = [(r, self.res.job_uri(r), self.plan.task_images.get(r.instance_id)) for r in chunk]
            handles = self.launcher.launch_many(items)  # ECS: RunTask calls in parallel, up to the quota
            for ref, handle in zip(chunk, handles):
                self.running[ref] = Running(handle=handle, started=now, held_at=self.held_total_s)
            t2 = time.monotonic()
            self.busy_s["job documents"] += t1 - t0
            self.busy_s["launch"] += t2 - t1
            if t2 > deadline:
                self.launch_backlog = i + LAUNCH_CHUNK < len(batch)
                break

    def launch_report(self) -> str | None:
        return self.launcher.launch_report()

    def _pending(self, landed: dict):
        """Attempts without a row and without a task of ours, in plan order (a cursor, not a rescan)."""
        while self._cursor < len(self.plan.refs):
            ref = self.plan.refs[self._cursor]
            if (ref.instance_id, ref.attempt) in landed or ref in self.running:
                self._cursor += 1
                continue
            break
        for ref in self.plan.refs[self._cursor:]:
            if (ref.instance_id, ref.attempt) not in landed and ref not in self.running and ref not in self.waiting:
                yield ref

    def _reap(self, landed: dict, now: float) -> None:
        """Follow every task to its end. A task past its wall-time limit is stopped; one that does not stop within
        backend.result_wait_s counts as gone. Once a task is gone and its attempt has no row, the row is due: after
        REAP_GRACE_S if the task never marked its result sent, after backend.result_wait_s if it did (the writer
        may be that far behind); then the driver lands it (_resolve)."""
        wall, bound = self.plan.spec.budget.wall_time_s, self.plan.spec.backend.result_wait_s
        due: list[AttemptRef] = []
        gone: list[tuple[AttemptRef, Running]] = []  # just seen gone without a row: is their result said to be sent?
        placed: list[tuple] = []  # the capacity each ended task ran on, for its landed row (priced by it)
        for ref, t in list(self.running.items()):
            if t.exit_code is None:
                t.exit_code = self.launcher.poll(t.handle)
                if t.exit_code is not None:
                    t.exited_at = now
                elif t.stopped_at is None and now - t.started > wall + STOP_GRACE_S + self.held_total_s - t.held_at:
                    self._stop(ref, t, "wall_time")  # the task's own wall-time guard failed
                    t.stopped_at = now
                elif t.stopped_at is not None and now - t.stopped_at > bound:
                    t.exit_code, t.exited_at = -1, now  # stopped long ago and still not reported gone
            if (ref.instance_id, ref.attempt) in landed:
                if t.exit_code is not None:
                    del self.running[ref]
                    if t.handle.capacity:
                        placed.append((t.handle.capacity, ref.run, ref.instance_id, ref.attempt))
                continue
            if t.exit_code is None:
                continue
            if t.resolve_at is None:
                gone.append((ref, t))
            elif now >= t.resolve_at:
                due.append(ref)
        if placed:
            with self.conn.cursor() as cur:
                cur.executemany("UPDATE attempts SET task_capacity = %s"
                                " WHERE run = %s AND instance_id = %s AND attempt = %s", placed)
            self.conn.commit()
        for (ref, t), sent in zip(gone, self._results_sent([r for r, _ in gone])):
            t.result_sent = sent
            t.resolve_at = t.exited_at + (bound if sent else REAP_GRACE_S)
            if now >= t.resolve_at:
                due.append(ref)
        if any(self.running[r].result_sent for r in due) and self._results_waiting(now):
            # A sent result may be among the messages the writers have not reached yet: its bound runs from when
            # the results queue was last seen holding any, not from its task's exit.
            for ref in [r for r in due if self.running[r].result_sent]:
                self.running[ref].resolve_at = self.results_busy_at + bound
                due.remove(ref)
        deadline = time.monotonic() + PASS_BUDGET_S
        for ref in due:
            self._resolve(ref, self.running[ref], now)
            if time.monotonic() > deadline:
                break  # the rest next pass

    def _results_waiting(self, now: float) -> bool:
        """Whether the results queue held a message (waiting or being landed) within backend.result_wait_s."""
        attrs = aws.client("sqs").get_queue_attributes(QueueUrl=self.res.results_queue_url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        if any(int(v) for v in attrs.values()):
            self.results_busy_at = now
        return now - self.results_busy_at < self.plan.spec.backend.result_wait_s

    def _resolve(self, ref: AttemptRef, t: Running, now: float) -> None:
        """Land the row of an attempt whose task is gone and whose row did not come: from the task's S3 copy of
        its result if it left one, else as infra_error with the ledger rows of its S3 ledger copy."""
        bound = self.plan.spec.backend.result_wait_s
        if t.result_sent:
            why = (f"lost_result: the task sent its result and exited (code {t.exit_code}), but no row landed"
                   f" within {bound:g} s")
        elif reason := self.launcher.exit_reason(t.handle):  # e.g. oom_killed: its class, not the model's doing
            why = f"{reason}: the task ended (code {t.exit_code}) without sending its result"
        else:
            why = f"task_died: exited with code {t.exit_code} without sending its result"
        try:
            how = self._land_unreported(ref, lambda rows: unreported_result(self.plan, ref, why, rows))
        except Exception:  # S3 or the database unreachable: the same again shortly
            log.exception("could not land %s; trying again in %g s", ref.slug, RETRY_RESOLVE_S)
            t.resolve_at = now + RETRY_RESOLVE_S
            return
        log.warning("%s: landed from %s (%s)", ref.slug, "its S3 result copy" if how == "copy" else "what it left",
                    why)
        if how == "lost" and why.startswith(SPOT_INTERRUPTED):
            self._relaunch_once(ref)
        t.resolve_at = now + bound  # its row is in; should it somehow not be, the same again after the bound

    def _relaunch_once(self, ref: AttemptRef) -> None:
        """A Spot-interrupted attempt is relaunched as a new attempt of its slot (as `retry` does), within the run's
        remaining budget; an attempt that is itself such a relaunch is not (its slot was interrupted twice)."""
        from dispatcher.retry import pick

        run, budget = self.plan.spec.run.name, self.plan.spec.budget
        try:
            mine = [a for a in store.current_attempts(self.conn, run)
                    if (a["instance_id"], a["attempt"]) == (ref.instance_id, ref.attempt)]
            if store.retry_reason(self.conn, ref) == SPOT_INTERRUPTED:
                mine = []
            picks, _ = pick(mine, {SPOT_INTERRUPTED}, budget.run_usd - store.spent_usd(self.conn, run),
                            budget.attempt_usd)
            for iid, attempt in store.add_retries(self.conn, run, picks):
                log.warning("%s: relaunched as attempt %d (%s)", ref.slug, attempt, SPOT_INTERRUPTED)
            self.conn.commit()
        except psycopg.Error:
            self.conn.rollback()
            log.exception("could not relaunch %s (`retry --status %s` does)", ref.slug, SPOT_INTERRUPTED)

    def _land_unreported(self, ref: AttemptRef, lost) -> str | None:
        """ResultsWriter.land_unreported, then `landed` learns the row at once (no relaunch in this pass)."""
        how = self.resolver.land_unreported(ref, lost)
        if how is not None:
            self.resolved[how] += 1
            row = self.conn.execute("SELECT status FROM attempts WHERE run = %s AND instance_id = %s AND attempt = %s",
                                    (ref.run, ref.instance_id, ref.attempt)).fetchone()
            self.conn.commit()
            if row and self.landed is not None:
                self.landed[(ref.instance_id, ref.attempt)] = row[0]
        return how

    def _await_verdicts(self, now: float) -> None:
        """Patches waiting for verdicts that will never come land as infra_error (verdict_lost), so the run ends.

        What the system records of a grading's life is its eval job's message: while a grader holds it, the
        message is in flight (the grader keeps extending its visibility); a grader that dies lets it reappear for
        another, and after resources.MAX_RECEIVES deliveries it goes to the eval dead-letter queue. So:
        - a job in the dead-letter queue: its attempt lands as verdict_lost once eval.verdict_wait_s has passed
          (a verdict one of its graders sent may still be on its way);
        - a verdict lost after its job was done (the grader deleted the job): the job is in neither queue, and
          the run's eval queue empties once the other jobs are graded. An attempt still PATCH_READY
          eval.verdict_wait_s after the eval queue was last seen holding a job, and as long after its own job was
          sent, lands as verdict_lost. Slow grading never trips it: its job is in flight all along.
        A patch committed whose job never went out (the writer failed between the two) is sent again instead."""
        bound = self.plan.spec.eval.verdict_wait_s
        run = self.plan.spec.run.name
        sqs = aws.client("sqs")
        for _ in range(10):  # the dead-letter queue, ten a call: noted, then deleted (the note is the driver's)
            msgs = sqs.receive_message(QueueUrl=self.res.eval_dlq_url, MaxNumberOfMessages=10,
                                       WaitTimeSeconds=0).get("Messages", [])
            for m in msgs:
                try:
                    ref = EvalJob.model_validate_json(m["Body"]).ref
                    if ref.run == run:
                        self.dead_jobs.setdefault(ref, now)
                except ValueError as e:
                    log.error("not an eval job in the eval dead-letter queue, dropped: %s", e)
            if msgs:
                sqs.delete_message_batch(QueueUrl=self.res.eval_dlq_url, Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(msgs)])
            if len(msgs) < 10:
                break
        dead = [ref for ref, seen in self.dead_jobs.items() if now - seen >= bound]
        if dead:
            self._land_verdicts_lost(dead, f"its eval job went to the dead-letter queue after"
                                           f" {resources.MAX_RECEIVES} deliveries (its graders died or failed)")
            for ref in dead:
                del self.dead_jobs[ref]
        attrs = sqs.get_queue_attributes(QueueUrl=self.res.eval_queue_url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed"])["Attributes"]
        if any(int(v) for v in attrs.values()):
            self.eval_busy_at = now
            return
        if now - self.eval_busy_at < bound:
            return
        rows = self.conn.execute(
            "SELECT instance_id, attempt, eval_enqueued_at IS NULL AND patch_uri IS NOT NULL FROM attempts"
            " WHERE run = %s AND status = 'PATCH_READY'"
            " AND coalesce(eval_enqueued_at, landed_at) < now() - make_interval(secs => %s)",
            (run, bound)).fetchall()
        self.conn.commit()
        lost = [ref for ref in (AttemptRef(run=run, instance_id=i, attempt=a) for i, a, unsent in rows if not unsent)
                if ref not in self.dead_jobs]  # those land from the dead-letter queue, with that reason
        for ref in (AttemptRef(run=run, instance_id=i, attempt=a) for i, a, unsent in rows if unsent):
            log.warning("%s: its patch was never sent to grading; sending it now", ref.slug)
            try:
                self.resolver.enqueue_eval([ref])
            except (ClientError, ValueError) as e:  # its job document gone or unreadable: no grading will come
                self._land_verdicts_lost([ref], f"its eval job could not be sent: {e}")
        if lost:
            self._land_verdicts_lost(lost, f"no verdict within {bound:g} s of its eval job's last sign of life (the"
                                           f" run's eval queue held no job for that long)")

    def _land_verdicts_lost(self, refs: list[AttemptRef], why: str) -> None:
        for ref in self.resolver.land_verdicts_lost(refs, why):
            self.verdicts_lost += 1
            log.warning("%s: landed as infra_error (verdict_lost: %s)", ref.slug, why)

    def _results_sent(self, refs: list[AttemptRef]) -> list[bool]:
        """Whether each task marked its progress key done, which it does once its result is on the queue: then the
        row is coming, however far behind the writer is, and gets backend.result_wait_s to land. (The exit code is no
        evidence: a task the dispatcher stopped lands itself as cancelled and exits 0; one that never ran may too.)"""
        if not refs:
            return []
        with self.valkey.pipeline(transaction=False) as p:
            for r in refs:
                p.hget(keys.progress(r), "phase")
            return [phase in (b"done", "done") for phase in p.execute()]

    def _resize(self, landed: dict) -> None:
        state = ray.get(self.pacer.tick.remote())
        self.limits = state["limits"]
        obs = self.observed = observe(self.conn, self.plan.spec.pool)
        remaining = len(self.plan.refs) - sum(self.counts.values())
        active = sum(1 for t in self.running.values() if t.exit_code is None)
        self.target = self.planner.target(self.limits, obs, remaining, max(active, self.target))

    def _stop(self, ref: AttemptRef, t: Running, why: str) -> None:
        """Stop a task, first telling it the dispatcher does: it then lands itself as cancelled. (A task stopped by
        anyone else sends no result: the launcher's exit reason, e.g. spot_interrupted, lands it.)"""
        key = keys.progress(ref)
        try:
            with self.valkey.pipeline() as p:
                p.hset(key, keys.PROGRESS_STOPPED_BY, why)
                p.expire(key, keys.PROGRESS_TTL_S, nx=True)  # a task not beating yet leaves no key behind for long
                p.execute()
        except redis.RedisError:  # the task will land as stopped from outside (infra_error), not as cancelled
            log.exception("could not tell %s that the dispatcher stops it", ref.slug)
        self.launcher.stop(t.handle)

    def _cancel(self, landed: dict) -> None:
        """Stop running tasks (they land as cancelled) and land every attempt never launched as cancelled."""
        for ref, t in self.running.items():
            if t.exit_code is None and ref not in self.cancel_sent:
                self._stop(ref, t, "cancel")
                self.cancel_sent.add(ref)
        never = [ref for ref in self.plan.refs if (ref.instance_id, ref.attempt) not in landed
                 and ref not in self.running and ref not in self.cancel_sent]
        for ref, is_live in zip(never, self._live(never)):
            if is_live:
                continue  # an earlier dispatcher's task: it lands its own row
            land_attempt(self.res, self.plan, ref, HarnessOutcome.CANCELLED, "run cancelled before launch",
                         self.run_keys)
            self.cancel_sent.add(ref)


def take_retries(conn: psycopg.Connection, plan: Plan) -> int:
    """Append to the plan the attempts `retry` added to its run that it does not have yet; returns how many."""
    run, known = plan.spec.run.name, set(plan.refs)
    new = [ref for ref in (AttemptRef(run=run, instance_id=i, attempt=a) for i, a in store.retried(conn, run))
           if ref not in known]
    conn.commit()
    plan.refs += new
    return len(new)


def carry_run_spend(valkey, run: str, spent_usd: float) -> None:
    """A run driven again after its end (`retry`) finds its budget key gone with its other keys: the shims' run cap
    starts from what the run's rows say it spent, not from zero. A key still there (a resumed driver) is kept."""
    key = keys.run_budget(run)
    if valkey.hsetnx(key, "spent", round(spent_usd * 1_000_000)):
        valkey.expire(key, KEY_TTL_S)


def remove_run_keys(valkey, run: str) -> int:
    """The run's Valkey keys (progress, budgets, its call hold) go with the run; pool keys stay (pools outlive
    runs)."""
    n = valkey.delete(keys.run_hold(run))
    for key in valkey.scan_iter(match=f"ep:run:{{{run}}}:*", count=1000):
        n += valkey.delete(key)
    return n


def _agent_port_of_its_own() -> None:
    """ray.init cannot choose its dashboard agent's port (a fixed 52365; ray-project/ray#14763, #37229): a second
    local cluster on the host (another run, another test session) would fail to start. RayParams gets a free one."""
    from ray._private import parameter

    init = parameter.RayParams.__init__
    if getattr(init, "free_agent_port", False):
        return

    def with_free_agent_port(self, *args, **kwargs):
        kwargs.setdefault("dashboard_agent_listen_port", free_port())
        init(self, *args, **kwargs)

    with_free_agent_port.free_agent_port = True
    parameter.RayParams.__init__ = with_free_agent_port


def ray_init(dashboard: bool, aws_env: dict[str, str]) -> None:
    if ray.is_initialized():
        return
    _agent_port_of_its_own()
    # the raylet waits this long (30 s by default) for that agent, which a loaded host takes longer to start
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    # A local cluster's files (its logs record the runtime_env, credentials included) under a 0700 folder of ours:
    # Ray's default /tmp/ray, and any folder it makes itself, are open to every user of the host (the agent's too)
    temp_dir = None if address else os.path.join(tempfile.mkdtemp(prefix="evalplane-ray-"), "ray")
    ray.init(
        # "local" starts a cluster of this run's own: without it Ray attaches to any cluster it finds on the host
        address=address or "local",
        _temp_dir=temp_dir,
        num_cpus=None if address else 2,
        include_dashboard=dashboard,
        log_to_driver=False,
        namespace="evalplane",
        runtime_env={"env_vars": aws_env | {"DATABASE_URL": db.database_url()}},
        logging_level=logging.WARNING,
        configure_logging=True,
    )
