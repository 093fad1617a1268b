"""One agent task: `python -m harness <job-uri>`.

fetch the job -> the repository at its base commit, pruned of everything after it (baked into the task image at
/testbed, or cloned from a bundle by the process launcher) -> start the shim on 127.0.0.1 (the only process that
holds the run's provider key) -> run the harness against the shim, in the instance's own environment (its conda env
`testbed` active) without any secret -> take the patch (git diff against the base commit) -> upload patch,
trajectory and ledger -> send the attempt's result to the results queue. Whatever happens, a result is sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from contract import aws, keys, signing, task_shape, valkey_auth
from contract.models import (
    OOM_KILLED,
    PROVIDER_OUTAGE,
    AttemptRef,
    AttemptResult,
    CallRecord,
    Envelope,
    HarnessOutcome,
    Job,
    LedgerBatch,
    Totals,
    utcnow,
)
from harness import sandbox, usage
from harness.adapters import HarnessAdapter, load_adapter
from plumbing import services
from shim.child import shim_service
from shim.config import ShimConfig

log = logging.getLogger("evalplane.task")
UPSTREAM_KEY_ENV = task_shape.UPSTREAM_KEY_ENV
PRUNE_HISTORY = Path(__file__).with_name("prune_history.sh")
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
PRIVATE_PREFIXES = ("AWS_", "EVALPLANE_", "SHIM_", "DATABASE_URL", "VALKEY_URL", "RAY_")
SCRATCH_FILES = ("patch.txt",)  # files harnesses are told to write in the repo; never part of the patch
LEDGER_MESSAGE_BYTES = 240_000  # SQS allows 256 KiB
DONE_TTL_S = 600  # the "result sent" mark outlives the slowest task-exit detection (ECS describe lag)


def git(testbed: Path, *args: str, check: bool = True, agent: sandbox.Agent | None = None) -> str:
    """git in the repository; with agent, as the agent (its repository: git as root there would run its hooks)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(testbed.parent),
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0"}
    p = subprocess.run(["git", *args], cwd=testbed, env=env, capture_output=True, text=True,
                       **(agent.popen_kwargs() if agent else {}), check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout


class SetupFailed(Exception):
    """The attempt could not be set up (no repository, no environment): it failed before the agent could work."""


def prune_history(testbed: Path, base_commit: str) -> None:
    """Nothing after the base commit stays reachable (harness/prune_history.sh, the rule the task image applies)."""
    p = subprocess.run(["sh", str(PRUNE_HISTORY), str(testbed), base_commit], capture_output=True, text=True,
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(testbed.parent),
                            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0"}, check=False)
    if p.returncode != 0:
        raise SetupFailed(p.stderr.strip() or f"prune_history exited {p.returncode}")


def checkout(job: Job, testbed: Path) -> None:
    """The repository at the base commit with no history after it. Baked into the task image at /testbed (pruned
    when the image was built; checked again here), or cloned from a bundle (the process launcher) and pruned."""
    base = job.instance["base_commit"]
    if Path(job.repo_source) != testbed:
        if testbed.exists():
            shutil.rmtree(testbed)
        p = subprocess.run(["git", "clone", "-q", "--no-hardlinks", job.repo_source, str(testbed)],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise SetupFailed(f"git clone {job.repo_source} failed: {p.stderr.strip()}")
        try:
            git(testbed, "checkout", "-q", "--detach", base)
        except RuntimeError as e:
            raise SetupFailed(str(e)) from None
    elif not (testbed / ".git").is_dir():
        raise SetupFailed(f"{testbed} holds no repository (is this the instance's task image?)")
    prune_history(testbed, base)
    git(testbed, "config", "user.email", "agent@evalplane.invalid")
    git(testbed, "config", "user.name", "agent")


def instance_env() -> dict[str, str]:
    """The environment the agent's commands run in: the instance's own, as its image activates it (conda env
    `testbed`), or, outside an instance image (the process launcher), this task's. Never a secret or an endpoint:
    those are the task runner's and the shim's alone."""
    env = dict(os.environ)
    if Path("/opt/miniconda3/bin/activate").exists():
        base = {k: env[k] for k in ("PATH", "HOME", "LANG", "TERM") if k in env}
        p = subprocess.run(["bash", "-c", task_shape.CONDA_ACTIVATE + " >/dev/null && env -0"], env=base,
                           capture_output=True, check=False)
        if p.returncode != 0:
            raise SetupFailed(f"the instance's environment does not activate: {p.stderr.decode(errors='replace')}")
        env = dict(kv.split("=", 1) for kv in p.stdout.decode().split("\0") if "=" in kv)
    return {k: v for k, v in env.items()
            if not any(m in k.upper() for m in SECRET_MARKERS) and not k.startswith(PRIVATE_PREFIXES)}


def take_patch(testbed: Path, base_commit: str, scratch: tuple[str, ...] = (),
               agent: sandbox.Agent | None = None) -> str:
    """Everything the agent changed against the base commit, new files included, scratch files (ours and the
    harness's) excluded. Taken as the agent: the repository (its config, hooks, attributes) is the agent's to shape,
    the patch its to write; git as root there would run what the agent put in it."""
    git(testbed, "add", "-A", agent=agent)
    for f in (*SCRATCH_FILES, *scratch):
        git(testbed, "reset", "-q", "--", f, check=False, agent=agent)
    return git(testbed, "diff", "--cached", "--binary", base_commit, agent=agent)


class Shim:
    """The shim as a child process; the provider key is in its environment and nowhere else."""

    def __init__(self, job: Job, workdir: Path, key: str):
        self.token = "local-" + secrets.token_hex(16)
        self.status_file = workdir / "shim.status.json"
        self.ledger = workdir / "ledger.jsonl"
        cfg = ShimConfig(
            upstream_url=job.upstream_url, provider=job.model.provider, model=job.model.model, pool=job.model.pool,
            upstream_model=job.model.alias,
            ref=job.ref, local_token=self.token, ledger_path=self.ledger, valkey_url=job.valkey_url,
            results_queue_url=job.results_queue_url, limits=job.limits, run_cost_usd=job.run_cost_usd,
            port_file=workdir / "shim.port", status_path=self.status_file,
            flush_on_exit=False,  # its last rows ride with the attempt's result (unsent_rows, send_result)
        )
        self.service = shim_service(cfg, workdir / "shim.json", key, log=workdir / "shim.log",
                                    module=("harness.sandbox", "shim"), timeout_s=30, grace_s=60).start()
        self.proc = self.service.proc
        self.url = f"http://127.0.0.1:{self.service.port}"

    def status(self) -> dict:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/_shim/status", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return {}

    def stop(self) -> dict:
        """SIGTERM: the shim stops and writes its status (which names the ledger rows it did not send)."""
        self.service.stop()
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}


def unsent_rows(ledger: Path, status: dict) -> list[CallRecord]:
    """The ledger rows the shim had not sent when it stopped (its status names their seqs), from its ledger file."""
    seqs = set(status.get("unsent_seqs") or ())
    if not seqs or not ledger.exists():
        return []
    rows = [CallRecord.model_validate_json(line) for line in ledger.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.seq in seqs]


def send_result(queue_url: str, result: AttemptResult, tail: list[CallRecord], copy_uri: str | None = None,
                sign: signing.Signer | None = None) -> None:
    """The result with the unsent rows, as one message; if that would not fit in an SQS message, the rows go as
    ledger batches of their own (the writer absorbs any row it sees twice). Returns once SQS has stored every
    message as sent (contract.aws checks each, failed batch entries included), else raises. First, the whole
    message goes to S3 (copy_uri): if it is lost on its way, the dispatcher lands this copy. sign: the attempt key's
    signer (contract.signing): every message and the copy carry its signature."""
    body = Envelope(msg=result.model_copy(update={"ledger": tail})).model_dump_json()
    if copy_uri:
        try:
            aws.put_text(copy_uri, body, sign=sign)
        except Exception:  # the queue is the way results travel; the copy only covers its loss
            log.exception("storing the result's S3 copy failed; sending the result all the same")
    bodies = [body]
    if len(body.encode()) > LEDGER_MESSAGE_BYTES:
        bodies = [*ledger_bodies(result.ref, tail), Envelope(msg=result).model_dump_json()]
    aws.send_batch(queue_url, bodies, sign=sign)


def ledger_bodies(ref: AttemptRef, rows: list[CallRecord]) -> list[str]:
    """The rows as ledger batch messages, as many rows to a message as fit."""
    bodies, i = [], 0
    while i < len(rows):
        n = len(rows) - i
        while True:  # as many rows as fit in one message
            batch = Envelope(msg=LedgerBatch(ref=ref, rows=rows[i:i + n])).model_dump_json()
            if len(batch.encode()) <= LEDGER_MESSAGE_BYTES or n == 1:
                break
            n = max(1, n // 2)
        bodies.append(batch)
        i += n
    return bodies


SHIM_LOG_TAIL = 1 << 20


def store_artifacts(prefix: str, workdir: Path, patch: str,
                    sign: signing.Signer | None = None,
                    trajectory: Path | None = None) -> tuple[str | None, str | None, list[str]]:
    """Patch, trajectory, ledger copy and the shim's log (its tail: why a call failed) to S3, each upload on its own:
    whatever fails, the task still sends its result (with the shim's unsent ledger rows), saying what is missing.
    Returns (patch_uri, trajectory_uri, problems)."""
    uris: dict[str, str] = {}
    problems = []
    traj, ledger = trajectory or workdir / "trajectory.json", workdir / "ledger.jsonl"
    for name, body, kind in (("patch.diff", patch, "text/x-diff"),
                             ("trajectory.json", sandbox.read_agent_file(traj), "application/json"),
                             ("ledger.jsonl", ledger.read_bytes() if ledger.exists() else None, "application/x-ndjson"),
                             ("shim.log", services.log_tail(workdir / "shim.log", SHIM_LOG_TAIL), "text/plain")):
        if not body:
            continue
        try:
            aws.put_text(prefix + name, body, kind, sign=sign)
            uris[name] = prefix + name
        except Exception as e:
            log.exception("uploading %s failed", name)
            problems.append(f"{name} not stored: {type(e).__name__}")
    return uris.get("patch.diff"), uris.get("trajectory.json"), problems


class Heartbeat:
    """The attempt's progress key, kept alive while the task lives: the dispatcher's sign not to relaunch it."""

    def __init__(self, job: Job):
        import redis

        self.r = redis.Redis.from_url(valkey_auth.with_credentials(job.valkey_url))  # the run's user, from the env
        self.key = keys.progress(job.ref)
        self.stop_event = threading.Event()
        self.beat("starting")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def beat(self, phase: str | None = None) -> None:
        with self.r.pipeline() as p:
            if phase:
                p.hset(self.key, mapping={"phase": phase, "pid": os.getpid(), "host": os.uname().nodename})
            p.expire(self.key, keys.PROGRESS_TTL_S)
            p.execute()

    def _run(self) -> None:
        while not self.stop_event.wait(keys.PROGRESS_TTL_S / 4):
            try:
                self.beat()
            except Exception:  # a missed beat is retried; the TTL leaves room for several
                log.warning("progress heartbeat failed", exc_info=True)

    def finish(self, outcome: str) -> None:
        """The result is on the queue: keep the key a little longer, until the writer has landed it."""
        self.stop_event.set()
        self.r.hset(self.key, mapping={"phase": "done", "outcome": outcome})
        self.r.expire(self.key, DONE_TTL_S)

    def stopped_by(self) -> str | None:
        """Why the dispatcher stopped this task (it says so before it does), None if it did not: then whoever sent
        the SIGTERM (Spot taking the capacity back, an operator) did. Unreadable: taken as the dispatcher's stop."""
        try:
            why = self.r.hget(self.key, keys.PROGRESS_STOPPED_BY)
        except Exception:  # Valkey unreachable: a stop that cannot be told apart lands as cancelled
            log.warning("could not read who stopped this task; landing it as cancelled", exc_info=True)
            return "unknown"
        return why.decode() if why is not None else None

    def abandon(self) -> None:
        """No result will come from this task: the key says so (never "done") and goes with its TTL."""
        self.stop_event.set()
        try:
            self.r.hset(self.key, "phase", "stopped")
        except Exception:  # the key expires by itself
            log.warning("could not mark the progress key stopped", exc_info=True)


def run_harness(job: Job, adapter: HarnessAdapter, testbed: Path, workdir: Path, shim: Shim, agent_home: Path,
                agent: sandbox.Agent | None, own_network: bool = False) -> tuple[HarnessOutcome, str | None]:
    """How the harness phase ended, and why where it was not the harness's own doing. The harness runs as the
    agent (harness/sandbox.py), its files in agent_home; with own_network (on a host, not in a task container), in
    a network of its own where only the shim's port leads anywhere; whatever it leaves running is killed when it
    ends."""
    hr = adapter.prepare(job, testbed, agent_home, shim.url, shim.token, instance_env())
    assert UPSTREAM_KEY_ENV not in hr.env and "SHIM_UPSTREAM_KEY" not in hr.env
    deadline = time.monotonic() + (job.limits.wall_time_s or 1e9)
    with contextlib.ExitStack() as files:
        logf = files.enter_context(open(workdir / "harness.log", "ab"))
        out = files.enter_context(open(hr.stdout, "ab")) if hr.stdout else logf
        stdin = files.enter_context(open(hr.stdin, "rb")) if hr.stdin else subprocess.DEVNULL
        if agent is not None:  # after the runner opened what it opens there: no link can be slipped in before
            agent.own(agent_home)
        relay = int(shim.url.rsplit(":", 1)[1]) if own_network else None
        argv, cwd = (agent.argv(hr.argv, testbed, relay), "/") if agent else (hr.argv, testbed)
        proc = subprocess.Popen(argv, env=hr.env, cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT if out is logf else logf,
                                stdin=stdin, start_new_session=True)
        stopped, timed_out, held, failing = None, False, 0.0, 0
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                status = shim.status()
                stopped, failing = status.get("stopped"), status.get("failing") or 0
                held = max(held, status.get("held_s") or 0.0)  # an outage's hold is not the attempt's time
                timed_out = time.monotonic() > deadline + held
                if stopped or timed_out:
                    break
        finally:  # on a cap, the wall-time limit, or our own SIGTERM: the harness's whole group goes
            if proc.poll() is None:
                services.terminate(proc, grace_s=10, group=True)
            sandbox.reap_agent(keep={shim.proc.pid})
        stopped = stopped or shim.status().get("stopped")
    try:
        adapter.collect(hr)
    except Exception:  # a trajectory we cannot read is a missing artifact, not a failed attempt
        log.exception("reading the harness's trajectory failed")
    if stopped == "rate_limited":  # the provider kept refusing past every retry: never the model's failure
        return HarnessOutcome.INFRA_ERROR, "rate_limited: the upstream refused calls past the shim's retries"
    if stopped == PROVIDER_OUTAGE:  # the pool's outage lasted longer than the run's bound: never the model's failure
        return HarnessOutcome.INFRA_ERROR, f"{PROVIDER_OUTAGE}: the provider's outage outlasted [budget] outage_bound_s"
    if stopped:
        return HarnessOutcome(stopped), None
    if timed_out and failing:  # the wall time ran out while the shim retried refused calls: the shim's own verdict
        return HarnessOutcome.INFRA_ERROR, "rate_limited: the attempt's wall time ran out while the upstream refused its calls"
    if timed_out:
        return HarnessOutcome.WALL_TIME_EXCEEDED, None
    return adapter.outcome(hr, proc.returncode), None


class Stopped(Exception):
    """SIGTERM: from the dispatcher (cancel, its wall-time guard: the attempt lands as cancelled), or from anyone else
    (Spot, an operator: no result; the dispatcher lands it from why the task stopped)."""


def _on_sigterm(signum, frame):
    raise Stopped()


def oom_verdict(meter: usage.Meter, job: Job, outcome: HarnessOutcome,
                error: str | None) -> tuple[HarnessOutcome, str | None]:
    """An attempt in which the kernel killed a process of the task for memory (the agent, or a command it ran) was
    cut short by the resources it was given, not by the model: infra_error, class oom_killed, never graded. A
    cancelled one stays cancelled."""
    if outcome is HarnessOutcome.CANCELLED or not meter.oom_killed():
        return outcome, error
    limit = f" of {job.resources.memory_limit_mib} MiB" if job.resources else ""
    why = f"{OOM_KILLED}: the kernel killed a process of the task at its memory limit{limit} (harness {outcome.value})"
    return HarnessOutcome.INFRA_ERROR, "; ".join(filter(None, [why, error]))


def main(argv: list[str]) -> int:
    meter = usage.Meter()  # first: the task's compute is counted from here
    signal.signal(signal.SIGTERM, _on_sigterm)
    sandbox.harden_runner()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s task %(levelname)s %(message)s")
    if len(argv) != 1:
        print("usage: python -m harness <job-uri>", file=sys.stderr)
        return 2
    job = Job.model_validate_json(aws.get_text(argv[0]))
    ref = job.ref
    state = Path(os.environ.get("EVALPLANE_STATE_DIR", task_shape.STATE_DIR))
    workdir = state / "tasks" / ref.run / ref.instance_id / str(ref.attempt)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(state / "tasks", 0o700)  # the runner's and the shim's files: closed to the agent
    in_image = job.repo_source == task_shape.TESTBED
    agent, agent_home, testbed = None, None, Path(job.repo_source)
    started = utcnow()
    outcome, error, patch, shim_status, shim = HarnessOutcome.INFRA_ERROR, None, "", {}, None
    stopped_outside = False  # a SIGTERM not from the dispatcher
    adapter: HarnessAdapter | None = None
    key = os.environ.pop(UPSTREAM_KEY_ENV, "")
    attempt_key = signing.key_from_env(signing.ATTEMPT_KEY_ENV)  # the shim, its child, signs its batches with it too
    sign = signing.signer(attempt_key) if attempt_key else None
    if sign is None:
        log.error("%s is not set: the results writer will refuse this task's messages", signing.ATTEMPT_KEY_ENV)
    heartbeat = Heartbeat(job)
    log.info("task started for %s (pid %d)", ref.slug, os.getpid())
    try:
        try:
            agent = sandbox.agent_for_task(in_image)
        except sandbox.SandboxError as e:
            raise SetupFailed(str(e)) from None
        agent_home = sandbox.agent_dir(agent)
        testbed = Path(job.repo_source) if in_image else agent_home / "testbed"
        checkout(job, testbed)
        if agent is not None:
            agent.own(testbed)
        adapter = load_adapter(job.harness.name)(job.harness.settings)
        shim = Shim(job, workdir, key)
        heartbeat.beat("harness")
        outcome, error = run_harness(job, adapter, testbed, workdir, shim, agent_home, agent, own_network=not in_image)
        patch = take_patch(testbed, job.instance["base_commit"], adapter.scratch, agent)
    except SetupFailed as e:  # before the agent could work: an infrastructure failure, never an empty patch
        log.error("setup failed: %s", e)
        error = f"setup failed: {e}"
    except Stopped:
        by = heartbeat.stopped_by()
        stopped_outside = by is None
        outcome, error = HarnessOutcome.CANCELLED, f"stopped by SIGTERM (the dispatcher's: {by})"
    except Exception as e:  # still land a row: the attempt failed on our side
        log.exception("task failed")
        error = f"{type(e).__name__}: {e}"
        outcome = HarnessOutcome.INFRA_ERROR
        try:
            patch = take_patch(testbed, job.instance["base_commit"], adapter.scratch if adapter else (), agent)
        except Exception:  # noqa: BLE001, S110 - no patch to keep (the repository is unusable): the result says why
            pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on, finish landing the row whatever comes
        if shim is not None:
            shim_status = shim.stop()
    patch_uri, traj_uri, problems = store_artifacts(job.artifacts_prefix, workdir, patch, sign,
                                                    agent_home / "trajectory.json" if agent_home else None)
    if agent_home is not None and not in_image:
        sandbox.remove_agent_dir(agent_home)
    if stopped_outside:  # the dispatcher learns why from its launcher (e.g. spot_interrupted) and lands the attempt
        try:  # the rows the shim had not sent; its S3 ledger copy holds them too
            if rows := unsent_rows(workdir / "ledger.jsonl", shim_status):
                aws.send_batch(job.results_queue_url, ledger_bodies(ref, rows), sign=sign)
        except Exception:  # the dispatcher lands the rows from the S3 ledger copy
            log.exception("sending the unsent ledger rows failed")
        heartbeat.abandon()
        log.warning("stopped by SIGTERM from outside the dispatcher: its ledger is sent, the dispatcher lands %s",
                    ref.slug)
        return 128 + signal.SIGTERM
    if patch and patch_uri is None:  # a patch the grader cannot fetch: not gradable, an infrastructure failure
        outcome, patch = HarnessOutcome.INFRA_ERROR, ""
    if problems:
        error = "; ".join(([error] if error else []) + problems)
    outcome, error = oom_verdict(meter, job, outcome, error)
    result = AttemptResult(
        ref=ref, harness=job.harness.name, pool=job.model.pool, model=job.model.model, outcome=outcome,
        patch_uri=patch_uri, patch_bytes=len(patch.encode()), trajectory_uri=traj_uri,
        ledger_calls=int(shim_status.get("ledger_rows", 0)), totals=Totals.model_validate(shim_status.get("totals", {})),
        started_at=started, ended_at=utcnow(), error=error, resources=job.resources, usage=meter.usage(),
    )
    send_result(job.results_queue_url, result, unsent_rows(workdir / "ledger.jsonl", shim_status),
                aws.result_copy_uri(job.artifacts_prefix), sign)
    heartbeat.finish(outcome.value)
    log.info("attempt %s landed as %s (%d patch bytes)", ref.slug, outcome.value, result.patch_bytes)
    return 0
