"""The dispatcher's main loop as a Ray driver: jobs to S3, one task per attempt, rows landed, run closed.

spec -> Plan -> (job document, task) per attempt -> results queue -> ResultsWriter -> rows -> report.
Resumable: attempts that already have a row are never relaunched, and attempts whose task is still
alive (its progress key in Valkey is fresh) are waited for, not launched twice.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import ray
import redis
from psycopg.types.json import Jsonb

from contract import aws, db, keys
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
from dispatcher.plan import Plan, spec_json
from dispatcher.progress import Progress
from dispatcher.resources import RunResources

log = logging.getLogger("evalplane.dispatcher")

REAP_GRACE_S = 20.0  # a task that exited without its result landing within this is landed as infra_error
UPSTREAM_KEY_ENV = "EVALPLANE_UPSTREAM_KEY"


class RunConflict(Exception):
    """The run name exists with a different spec."""


@dataclass
class Running:
    handle: TaskHandle
    started: float
    exited_at: float | None = None
    exit_code: int | None = None


@dataclass
class Services:
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def open_run(conn: psycopg.Connection, plan: Plan) -> str:
    """Insert the run row, or find it: returns 'new', 'resume' or 'finished'."""
    spec = plan.spec
    row = conn.execute("SELECT spec_hash, status FROM runs WHERE run = %s", (spec.run.name,)).fetchone()
    if row is None:
        conn.execute(
            "INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, %s, %s, %s)",
            (spec.run.name, Jsonb(spec_json(spec)), plan.spec_hash, spec.backend.kind, len(plan.refs)),
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


def start_simulator(plan: Plan, run_dir: Path, api_key: str) -> tuple[str, subprocess.Popen]:
    sim = plan.spec.simulator
    dataset = run_dir / "instances.jsonl"
    dataset.write_text("".join(_json_line(r) for r in plan.rows.values()))
    port_file = run_dir / "simulator.port"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "simulator", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
           "--dataset", str(dataset), "--policy", sim.policy if sim else "echo", "--api-key", api_key]
    for flag in ("rpm", "tpm", "itpm", "otpm"):
        if sim and getattr(sim, flag):
            cmd += [f"--{flag}", str(getattr(sim, flag))]
    if sim and sim.error_rate:
        cmd += ["--error-rate", str(sim.error_rate)]
    logf = open(run_dir / "simulator.log", "ab")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the provider simulator did not start; see {run_dir / 'simulator.log'}")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port_file.read_text().strip()}", proc


def _json_line(row: dict) -> str:
    import json

    return json.dumps(row, default=str) + "\n"


def start_eval_workers(plan: Plan, res: RunResources, run_dir: Path, env: dict[str, str]) -> list[subprocess.Popen]:
    procs = []
    for i in range(plan.spec.eval.workers):
        logf = open(run_dir / f"eval-worker-{i}.log", "ab")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "eval_worker", "--queue", res.eval_queue_url, "--logs-root", str(run_dir / "eval")],
            stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        ))
    return procs


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
        upstream_url=upstream_url,
        results_queue_url=res.results_queue_url,
        artifacts_prefix=res.artifacts_prefix(ref),
        valkey_url=valkey_url,
    )


def land_infra_error(res: RunResources, plan: Plan, ref: AttemptRef, why: str, started: float) -> None:
    """A task died without reporting: land its attempt (exactly one row) as an infrastructure error."""
    now = utcnow()
    msg = AttemptResult(
        ref=ref, harness=plan.spec.harness.name, pool=plan.spec.pool, model=plan.spec.model.model,
        outcome=HarnessOutcome.INFRA_ERROR, started_at=now, ended_at=now, error=why,
    )
    aws.send(res.results_queue_url, Envelope(msg=msg).model_dump_json())


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
    if spec.backend.kind != "local":
        raise NotImplementedError("backend 'aws' lands with the ECS launcher (issue 4)")
    localstack.ensure_moto()
    res = resources.ensure(run)
    services = Services()
    valkey = redis.Redis.from_url(valkey_url)
    try:
        if spec.model.base_url:
            upstream, key = spec.model.base_url, os.environ.get(spec.model.api_key_env, "")
            if not key:
                raise RuntimeError(f"model.api_key_env: environment variable {spec.model.api_key_env} is not set")
        else:
            key = "sk-sim-" + secrets.token_hex(16)
            upstream, sim = start_simulator(plan, run_dir, key)
            services.procs.append(sim)
        aws_env = {k: os.environ[k] for k in (*localstack.LOCAL_AWS_ENV, "AWS_ENDPOINT_URL") if k in os.environ}
        task_env = local_task_env({**aws_env, UPSTREAM_KEY_ENV: key, "EVALPLANE_STATE_DIR": str(localstack.state_dir()),
                                   "DATABASE_URL": db.database_url(), "VALKEY_URL": valkey_url})
        worker_env = local_task_env({**aws_env, "EVALPLANE_STATE_DIR": str(localstack.state_dir())})
        services.procs += start_eval_workers(plan, res, run_dir, worker_env)

        ray_init(spec.backend.dashboard, aws_env)
        writer = ResultsWriterActor.options(name=f"results-writer:{run}", namespace="evalplane",
                                            get_if_exists=True).remote(
            res.model_dump(), db.database_url(), aws_env, spec.eval.timeout_s)
        pacer = PoolPacer.options(name=f"pacer:{spec.pool}", namespace="evalplane", get_if_exists=True).remote(
            spec.pool, valkey_url, {"rpm": spec.model.rpm, "itpm": spec.model.itpm, "otpm": spec.model.otpm})
        ray.get(pacer.state.remote())

        launcher = ProcessLauncher(run_dir / "tasks", task_env)
        running: dict[AttemptRef, Running] = {}
        progress = Progress(console, run, len(plan.refs))
        while True:
            landed = landed_status(conn, run)
            final = sum(1 for s in landed.values() if s != "PATCH_READY")
            progress.update(landed, running)
            if final == len(plan.refs):
                break
            now = time.monotonic()
            for ref, t in list(running.items()):
                if (ref.instance_id, ref.attempt) in landed:
                    if t.exit_code is not None or launcher.poll(t.handle) is not None:
                        del running[ref]
                    continue
                if t.exit_code is None:
                    t.exit_code = launcher.poll(t.handle)
                    if t.exit_code is not None:
                        t.exited_at = now
                    elif now - t.started > spec.budget.wall_time_s + 120:
                        launcher.stop(t.handle)  # the task's own wall-time guard failed
                elif now - t.exited_at > REAP_GRACE_S:
                    land_infra_error(res, plan, ref, f"task exited with code {t.exit_code} without a result", t.started)
                    t.exited_at = float("inf")  # sent once; the writer's unique key absorbs any race
            for ref in plan.refs:
                if len([t for t in running.values() if t.exit_code is None]) >= spec.backend.concurrency:
                    break
                if (ref.instance_id, ref.attempt) in landed or ref in running:
                    continue
                if valkey.exists(keys.progress(ref)):
                    continue  # a task from an earlier dispatcher is still alive: wait for it
                job = make_job(plan, res, ref, upstream, valkey_url)
                aws.put_text(res.job_uri(ref), job.model_dump_json())
                running[ref] = Running(handle=launcher.launch(ref, res.job_uri(ref)), started=now)
            for p in services.procs:
                if p.poll() is not None and "eval_worker" in " ".join(map(str, p.args)):
                    raise RuntimeError(f"an eval worker exited with code {p.returncode}; see {run_dir}")
            time.sleep(0.5)
        progress.done()
        ray.get(writer.stop.remote())
        ray.kill(writer)
        conn.execute("UPDATE runs SET status = 'finished', finished_at = now() WHERE run = %s", (run,))
        conn.commit()
        resources.remove_queues(res)
        return "finished"
    finally:
        services.stop()
        conn.close()


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
