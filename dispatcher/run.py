"""The dispatcher's main loop as a Ray driver: jobs to S3, one task per attempt, rows landed, run closed.

spec -> Plan -> (job document, task) per attempt -> results queue -> ResultsWriter -> rows -> report.
Resumable: attempts that already have a row are never relaunched, and attempts whose task is still
alive (its progress key in Valkey is fresh) are waited for, not launched twice.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg
import ray
import redis
from psycopg.types.json import Jsonb

from contract import aws, db, keys, task_shape
from contract.models import (
    AttemptLimits,
    AttemptRef,
    AttemptResult,
    Envelope,
    HarnessOutcome,
    HarnessRef,
    Job,
    ModelRef,
    utcnow,
)
from dispatcher import localstack, resources
from dispatcher.actors import PoolPacer, ResultsWriterActor
from dispatcher.launchers.base import TaskHandle
from dispatcher.launchers.process import ProcessLauncher, local_task_env
from dispatcher.live import start_live
from dispatcher.local_services import LocalServices
from dispatcher.plan import Plan
from dispatcher.planner import Planner, observe
from dispatcher.progress import Progress
from dispatcher.resources import RunResources

log = logging.getLogger("evalplane.dispatcher")

REAP_GRACE_S = 20.0  # a task that exited without its result landing within this is landed as infra_error
UPSTREAM_KEY_ENV = task_shape.UPSTREAM_KEY_ENV


class RunConflict(Exception):
    """The run name exists with a different spec."""


@dataclass
class Running:
    handle: TaskHandle
    started: float
    exited_at: float | None = None
    exit_code: int | None = None
    result_sent: bool = False  # seen the task's "done" mark (or landed its infra_error ourselves)


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


def _json_line(row: dict) -> str:
    return json.dumps(row, default=str) + "\n"


def simulator_args(plan: Plan, run_dir: Path) -> list[str]:
    sim = plan.spec.simulator
    dataset = run_dir / "instances.jsonl"
    dataset.write_text("".join(_json_line(r) for r in plan.rows.values()))
    argv = ["--dataset", str(dataset), "--policy", sim.policy if sim else "echo"]
    for flag in ("rpm", "tpm", "itpm", "otpm"):
        if sim and getattr(sim, flag):
            argv += [f"--{flag}", str(getattr(sim, flag))]
    if sim and sim.error_rate:
        argv += ["--error-rate", str(sim.error_rate)]
    return argv


def make_job(plan: Plan, res: RunResources, ref: AttemptRef, upstream_url: str, valkey_url: str) -> Job:
    spec = plan.spec
    return Job(
        ref=ref,
        harness=HarnessRef(name=spec.harness.name, settings=spec.harness.settings | {"max_tokens": spec.model.max_tokens}),
        model=ModelRef(provider=spec.model.provider, model=spec.model.model, pool=spec.pool),
        limits=AttemptLimits(cost_usd=spec.budget.attempt_usd, max_turns=spec.budget.max_turns,
                             wall_time_s=spec.budget.wall_time_s),
        run_cost_usd=spec.budget.run_usd,
        instance=plan.rows[ref.instance_id],
        repo_source=plan.repo_sources[ref.instance_id],
        bundle=plan.bundles.get(ref.instance_id),
        upstream_url=upstream_url,
        results_queue_url=res.results_queue_url,
        artifacts_prefix=res.artifacts_prefix(ref),
        valkey_url=valkey_url,
    )


def make_launcher(plan: Plan, run_dir: Path, task_env: dict[str, str], key: str, upstream: str, valkey_url: str):
    """The local launchers: a subprocess per task, or a container per task behind the egress."""
    spec = plan.spec
    if spec.backend.launcher == "process":
        return ProcessLauncher(run_dir / "tasks", task_env)
    from dispatcher.launchers.docker import DockerLauncher

    aws_env = localstack.aws_env()
    endpoints = sorted({v for k, v in aws_env.items() if k.startswith("AWS_ENDPOINT_URL")})
    env = aws_env | {UPSTREAM_KEY_ENV: key, "EVALPLANE_STATE_DIR": task_shape.STATE_DIR}
    return DockerLauncher(env, [upstream, valkey_url, *endpoints], log_dir=run_dir / "tasks")


def land_attempt(res: RunResources, plan: Plan, ref: AttemptRef, outcome: HarnessOutcome, why: str) -> None:
    """Land an attempt that no task will report on (exactly one row, through the writer like any other)."""
    now = utcnow()
    msg = AttemptResult(
        ref=ref, harness=plan.spec.harness.name, pool=plan.spec.pool, model=plan.spec.model.model,
        outcome=outcome, started_at=now, ended_at=now, error=why,
    )
    aws.send(res.results_queue_url, Envelope(msg=msg).model_dump_json())


def land_infra_error(res: RunResources, plan: Plan, ref: AttemptRef, why: str) -> None:
    """A task died without reporting: land its attempt as an infrastructure error."""
    land_attempt(res, plan, ref, HarnessOutcome.INFRA_ERROR, why)


def execute(plan: Plan, valkey_url: str, console=None) -> str:
    """Run (or resume) the plan to the end. Returns 'finished' (or the earlier state if nothing was left)."""
    spec = plan.spec
    run = spec.run.name
    conn = db.connect()
    db.migrate(conn)
    state = open_run(conn, plan)
    if state == "finished":
        return state

    run_dir = localstack.state_dir() / "runs" / run
    run_dir.mkdir(parents=True, exist_ok=True)
    workers: list[subprocess.Popen] = []
    services = LocalServices(run_dir)
    if spec.backend.kind == "aws":
        from dispatcher.launchers.ecs import EcsLauncher
        from dispatcher.launchers.stack_outputs import StackOutputs

        outputs = StackOutputs.load(spec.backend.stack_outputs)
        res = resources.ensure(run, bucket=outputs.bucket, queue_prefix=outputs.queue_prefix)
        valkey_url = os.environ.get("VALKEY_URL") or outputs.valkey_url
        aws_env = localstack.aws_env()
    else:
        localstack.ensure_moto()
        res = resources.ensure(run)
    valkey = redis.Redis.from_url(valkey_url)
    try:
        if spec.backend.kind == "aws":
            # The provider key reaches tasks from Secrets Manager through their task definition, never from here.
            upstream = spec.model.base_url or outputs.gateway_url
            launcher = EcsLauncher.from_stack_outputs(outputs)
            launcher.launch_eval_workers(spec.eval.workers, run=run, command=[
                "--queue", res.eval_queue_url, "--backend", spec.eval.backend, "--idle-exit", "900"])
        else:
            if spec.model.base_url:
                upstream, key = spec.model.base_url, os.environ.get(spec.model.api_key_env, "")
                if not key:
                    raise RuntimeError(f"model.api_key_env: environment variable {spec.model.api_key_env} is not set")
            else:
                upstream, key = services.simulator(simulator_args(plan, run_dir), "sk-sim-" + secrets.token_hex(16))
            aws_env = localstack.aws_env()
            task_env = local_task_env({**aws_env, UPSTREAM_KEY_ENV: key,
                                       "EVALPLANE_STATE_DIR": str(localstack.state_dir()),
                                       "DATABASE_URL": db.database_url(), "VALKEY_URL": valkey_url})
            worker_env = local_task_env({**aws_env, "EVALPLANE_STATE_DIR": str(localstack.state_dir()),
                                         "DATABASE_URL": db.database_url()})
            workers = services.eval_workers(plan.spec.eval.workers, [
                "--queue", res.eval_queue_url, "--logs-root", str(run_dir / "eval"), "--backend", spec.eval.backend],
                worker_env)
            launcher = make_launcher(plan, run_dir, task_env, key, upstream, valkey_url)

        ray_init(spec.backend.dashboard, aws_env)
        writers = [ResultsWriterActor.options(name=f"results-writer:{run}:{i}", namespace="evalplane",
                                              get_if_exists=True).remote(
            res.model_dump(), db.database_url(), aws_env, spec.eval.timeout_s) for i in range(spec.backend.writer_count)]
        pacer = PoolPacer.options(name=f"pacer:{spec.pool}", namespace="evalplane", get_if_exists=True).remote(
            spec.pool, valkey_url, {"rpm": spec.model.rpm, "itpm": spec.model.itpm, "otpm": spec.model.otpm})
        ray.get(pacer.tick.remote())

        task_upstream, task_valkey = launcher.task_url(upstream), launcher.task_url(valkey_url)
        loop = DriverLoop(plan, res, conn, valkey, launcher, pacer,
                          lambda ref: make_job(plan, res, ref, task_upstream, task_valkey))
        # The live view (issue 27): the dashboard's keys, and the dashboard itself with backend.dashboard = true.
        progress = Progress(console, run, len(plan.refs), live=start_live(valkey, plan, loop, valkey_url, console))
        while not loop.step(progress):
            for w in workers:
                if w.poll() is not None:
                    raise RuntimeError(f"an eval worker exited with code {w.returncode}; see {run_dir}")
            time.sleep(0.5)
        progress.done()
        ray.get([w.stop.remote() for w in writers])
        for w in writers:
            ray.kill(w)
        conn.execute("UPDATE runs SET status = CASE WHEN status = 'cancelled' THEN status ELSE 'finished' END,"
                     " finished_at = now() WHERE run = %s", (run,))
        conn.commit()
        services.stop_all()
        resources.remove_queues(res)
        remove_run_keys(valkey, run)
        return "finished"
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        conn.close()


class DriverLoop:
    """One pass at a time: land-check, reap, cancel, size the fleet, launch. Returns True when all landed."""

    PLAN_EVERY_S = 10.0

    def __init__(self, plan: Plan, res: RunResources, conn, valkey, launcher, pacer, make_job_doc):
        self.plan, self.res, self.conn, self.valkey = plan, res, conn, valkey
        self.launcher, self.pacer, self.make_job_doc = launcher, pacer, make_job_doc
        self.running: dict[AttemptRef, Running] = {}
        self.planner = Planner(plan.spec.backend.concurrency)
        self.target = min(4, plan.spec.backend.concurrency)  # then grown by the planner while pacer wait is low
        self.limits: dict[str, int] = {}
        self._next_plan = 0.0
        self.cancel_sent: set[AttemptRef] = set()
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="jobdocs")
        self._cursor = 0
        self.busy_s = {"land check": 0.0, "reap": 0.0, "plan": 0.0, "job documents": 0.0, "launch": 0.0}
        self.landed: dict[tuple[str, int], str] | None = None  # (instance_id, attempt) -> status; see _refresh
        self.waiting: set[AttemptRef] = set()  # attempts an earlier dispatcher's task still holds (resume)

    def step(self, progress: Progress | None = None) -> bool:
        t0 = time.monotonic()
        counts = self._refresh()
        if progress:
            progress.update(counts, self.running)
        if sum(n for s, n in counts.items() if s != "PATCH_READY") == len(self.plan.refs):
            return True
        landed = self.landed
        now = time.monotonic()
        self.busy_s["land check"] += now - t0
        if hasattr(self.launcher, "retry_pending"):
            self.launcher.retry_pending()  # ECS: attempts not placed yet (capacity), when they are due
        self._reap(landed, now)
        if self._cancelled():
            self._cancel(landed)
            return False
        t1 = time.monotonic()
        self.busy_s["reap"] += t1 - now
        if now >= self._next_plan:
            self._resize(landed)
            self._next_plan = now + self.PLAN_EVERY_S
        self.busy_s["plan"] += time.monotonic() - t1
        self._launch(landed, now)
        return False

    def _refresh(self) -> dict[str, int]:
        """Bring `landed` up to date without rescanning the run: every row once, at the start; then, each pass,
        only the attempts the loop tracks (its tasks, and those an earlier dispatcher's task still holds), since
        no other attempt can land meanwhile. Returns the run's row count per status (an index-only count)."""
        run = self.plan.spec.run.name
        if self.landed is None:
            self.landed = landed_status(self.conn, run)
        tracked = [*self.running, *self.waiting]
        if tracked:
            rows = self.conn.execute(
                "SELECT a.instance_id, a.attempt, a.status FROM attempts a"
                " JOIN unnest(%s::text[], %s::int[]) AS t(iid, att) ON a.instance_id = t.iid AND a.attempt = t.att"
                " WHERE a.run = %s",
                ([r.instance_id for r in tracked], [r.attempt for r in tracked], run)).fetchall()
            self.landed.update({(i, a): s for i, a, s in rows})
        if self.waiting:
            self._recheck_waiting()
        counts = dict(self.conn.execute(
            "SELECT status, count(*) FROM attempts WHERE run = %s GROUP BY status", (run,)).fetchall())
        self.conn.commit()
        return counts

    def _recheck_waiting(self) -> None:
        """An earlier dispatcher's task is waited for while its progress key lives; once the key is gone and no
        row landed, the task died unheard and the attempt goes back to pending."""
        refs = list(self.waiting)
        self.waiting = {r for r, is_live in zip(refs, self._live(refs))
                        if is_live and (r.instance_id, r.attempt) not in self.landed}

    def _live(self, refs: list[AttemptRef]) -> list[bool]:
        """Whether each attempt's progress key exists (a task, ours or an earlier driver's, holds it)."""
        with self.valkey.pipeline(transaction=False) as p:
            for r in refs:
                p.exists(keys.progress(r))
            return [bool(n) for n in p.execute()]

    def _launch(self, landed: dict, now: float) -> None:
        """Up to the target: job documents first (written in parallel), then one task per attempt."""
        # A task counts until its row has landed: when results land slower than tasks finish (a slow writer,
        # a backed-up queue), launching stops instead of piling more results onto the queue.
        room = self.target - len(self.running)
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
        t0 = time.monotonic()
        docs = [(self.res.job_uri(r), self.make_job_doc(r).model_dump_json()) for r in batch]
        list(self.pool.map(lambda d: aws.put_text(*d), docs))
        t1 = time.monotonic()
        for ref in batch:
            handle = self.launcher.launch(ref, self.res.job_uri(ref), self.plan.task_images.get(ref.instance_id))
            self.running[ref] = Running(handle=handle, started=now)
        self.busy_s["job documents"] += t1 - t0
        self.busy_s["launch"] += time.monotonic() - t1

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
        wall = self.plan.spec.budget.wall_time_s
        for ref, t in list(self.running.items()):
            if t.exit_code is None:
                t.exit_code = self.launcher.poll(t.handle)
                if t.exit_code is not None:
                    t.exited_at = now
                elif now - t.started > wall + 120:
                    self.launcher.stop(t.handle)  # the task's own wall-time guard failed
            if (ref.instance_id, ref.attempt) in landed:
                if t.exit_code is not None:
                    del self.running[ref]
            elif t.exit_code is not None and not t.result_sent:
                t.result_sent = self._result_sent(ref)
                if not t.result_sent and now - t.exited_at > REAP_GRACE_S:
                    land_infra_error(self.res, self.plan, ref,
                                     f"task exited with code {t.exit_code} without a result")
                    t.result_sent = True  # sent once; the writer's unique key absorbs any race

    def _result_sent(self, ref: AttemptRef) -> bool:
        """A task marks its progress key done once its result is on the queue: then the row is coming, however far
        behind the writer is, and landing infra_error could race it. (The exit code is no evidence: a task
        stopped from outside lands itself as cancelled and exits 0; a task that never ran may report 0 too.)"""
        return self.valkey.hget(keys.progress(ref), "phase") in (b"done", "done")

    def _resize(self, landed: dict) -> None:
        state = ray.get(self.pacer.tick.remote())
        self.limits = state["limits"]
        obs = observe(self.conn, self.plan.spec.pool)
        remaining = len(self.plan.refs) - len(landed)
        active = sum(1 for t in self.running.values() if t.exit_code is None)
        self.target = self.planner.target(self.limits, obs, remaining, max(active, self.target))

    def _cancelled(self) -> bool:
        row = self.conn.execute("SELECT status FROM runs WHERE run = %s", (self.plan.spec.run.name,)).fetchone()
        self.conn.commit()
        return row is not None and row[0] == "cancelled"

    def _cancel(self, landed: dict) -> None:
        """Stop running tasks (they land as cancelled) and land every attempt never launched as cancelled."""
        for ref, t in self.running.items():
            if t.exit_code is None and ref not in self.cancel_sent:
                self.launcher.stop(t.handle)
                self.cancel_sent.add(ref)
        never = [ref for ref in self.plan.refs if (ref.instance_id, ref.attempt) not in landed
                 and ref not in self.running and ref not in self.cancel_sent]
        for ref, is_live in zip(never, self._live(never)):
            if is_live:
                continue  # an earlier dispatcher's task: it lands its own row
            land_attempt(self.res, self.plan, ref, HarnessOutcome.CANCELLED, "run cancelled before launch")
            self.cancel_sent.add(ref)


def remove_run_keys(valkey, run: str) -> int:
    """The run's Valkey keys (progress, budgets) go with the run; pool keys stay (pools outlive runs)."""
    n = 0
    for key in valkey.scan_iter(match=f"ep:run:{{{run}}}:*", count=1000):
        n += valkey.delete(key)
    return n


def ray_init(dashboard: bool, aws_env: dict[str, str]) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    ray.init(
        address=address or None,
        num_cpus=None if address else 2,
        include_dashboard=dashboard,
        log_to_driver=False,
        namespace="evalplane",
        runtime_env={"env_vars": aws_env | {"DATABASE_URL": db.database_url()}},
        logging_level=logging.WARNING,
        configure_logging=True,
    )
