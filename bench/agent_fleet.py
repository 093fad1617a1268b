"""The `agent` fleet of the throughput benchmark: tasks that do what harness/task.py does, with a simulated agent in
place of the harness.

Each task (a thread of the fleet process): its job from S3, its progress key kept alive (harness.task.Heartbeat), a
real shim in front of the provider (`python -m harness.sandbox shim`, the provider key in its environment only, the
attempt key signing its ledger batches), then the agent: a call through the shim, the work the reply asks for (the
simulator's trajectory policy says how long, and how much it adds to the conversation), the next call with the
conversation grown (the earlier turns read from the provider's prompt cache), until the policy submits. Then the shim
stops, and the result goes to the results queue with the shim's unsent rows (harness.task.send_result), as a real
task's. Threads, not processes, for the tasks themselves: they only wait (on the shim, on their think time); the
shims are processes, as in real tasks.

Besides exits, the fleet reports each task's timing to the driver side ("task", ...): when it started, when its agent
began and ended, and the calls whose answer was not 200 (what a harness would have seen).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from sim_launcher import FleetLauncher

from contract import aws, signing
from contract.models import AttemptRef, AttemptResult, HarnessOutcome, Job, Totals, utcnow
from dispatcher.launchers.base import AttemptEnv, no_attempt_env
from harness.task import Heartbeat, send_result, unsent_rows
from shim.child import shim_service
from shim.config import ShimConfig

HEAD = re.compile(r"TRAJECTORY (?:(submit)|think_s=([\d.]+) observe_chars=(\d+))")
SYSTEM = ("You are a software engineer fixing an issue in a repository, one shell command a turn. " * 60).strip()
# a task's problem statement grows to about this many characters (a real issue with its context: ~1,500 tokens)
STATEMENT_CHARS = 6000


def agent(url: str, token: str, job: Job, max_tokens: int) -> dict:
    """Follow the trajectory the simulator's policy draws for this task, through the shim. Returns the agent's
    counts: calls, answers other than 200 by status, the seconds it spent in its own work (think time)."""
    task = job.instance["problem_statement"]
    messages: list[dict] = [{"role": "user", "content": task}]
    seen: dict[str, int] = {}
    calls, think_s = 0, 0.0
    headers = {"x-api-key": token, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=url, timeout=httpx.Timeout(900.0, connect=10.0)) as c:
        while True:
            r = c.post("/v1/messages", headers=headers, json={
                "model": job.model.model, "max_tokens": max_tokens, "system": SYSTEM, "messages": messages})
            calls += 1
            if r.status_code != 200:  # what a harness would see: the shim absorbs 429s, or ends the attempt
                seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1
                break
            text = r.json()["content"][0]["text"]
            m = HEAD.match(text)
            if m is None or m.group(1):
                break
            work = float(m.group(2))
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "output:\n" + "." * int(m.group(3))}]
            time.sleep(work)  # the command runs
            think_s += work
    return {"calls": calls, "not_ok": seen, "think_s": think_s}


class AgentFleet:
    """Tasks as threads (see the module docstring); launches and exits through the pipe, as sim_launcher.Fleet."""

    def __init__(self, conn, upstream_key: str, workdir: str, max_tokens: int):
        self.conn, self.key, self.workdir, self.max_tokens = conn, upstream_key, Path(workdir), max_tokens
        self.threads = ThreadPoolExecutor(max_workers=2000, thread_name_prefix="task")
        self.lock = threading.Lock()
        self.exits: list[tuple[str, int, int]] = []
        self.timings: list[dict] = []
        self.shims: set = set()  # the shims running now (Service)

    def run(self) -> None:
        import signal

        def stop(signum, frame):  # the bench ends early: its shims go with the fleet (the threads cannot)
            for service in list(self.shims):
                service.stop(signal.SIGKILL, grace_s=1)
            os._exit(1)

        signal.signal(signal.SIGTERM, stop)
        while True:
            if self.conn.poll(0.05):
                msg = self.conn.recv()
                if msg[0] == "quit":
                    self.threads.shutdown(wait=True)
                    self._report()  # what the last tasks left, then the end of the reports
                    self.conn.send(("closed", None))
                    return
                for instance_id, attempt, job_uri, env in msg[1]:
                    self.threads.submit(self._task, instance_id, attempt, job_uri, env)
            self._report()

    def _report(self) -> None:
        with self.lock:
            exits, self.exits = self.exits, []
            timings, self.timings = self.timings, []
        if exits:
            self.conn.send(("exit", exits))
        if timings:
            self.conn.send(("tasks", timings))

    def _task(self, instance_id: str, attempt: int, job_uri: str, env: dict[str, str]) -> None:
        launched = time.time()
        code, timing = 1, {"instance_id": instance_id, "attempt": attempt, "launched": launched}
        try:
            timing |= self._attempt(job_uri, env)
            code = 0
        except Exception as e:  # noqa: BLE001 - any failure: the driver sees the exit code, lands what is left
            timing["error"] = f"{type(e).__name__}: {e}"
        timing["exited"] = time.time()
        with self.lock:
            self.exits.append((instance_id, attempt, code))
            self.timings.append(timing)

    def _attempt(self, job_uri: str, env: dict[str, str]) -> dict:
        job = Job.model_validate_json(aws.get_text(job_uri))
        key = env.get(signing.ATTEMPT_KEY_ENV)
        sign = signing.signer(key.encode()) if key else None
        workdir = self.workdir / job.ref.run / job.ref.instance_id / str(job.ref.attempt)
        workdir.mkdir(parents=True, exist_ok=True)
        heartbeat = Heartbeat(job)
        started = utcnow()
        token = "local-" + secrets.token_hex(16)
        status_file, ledger = workdir / "shim.status.json", workdir / "ledger.jsonl"
        cfg = ShimConfig(
            upstream_url=job.upstream_url, provider=job.model.provider, model=job.model.model, pool=job.model.pool,
            ref=job.ref, local_token=token, ledger_path=ledger, valkey_url=job.valkey_url,
            results_queue_url=job.results_queue_url, limits=job.limits, run_cost_usd=job.run_cost_usd,
            port_file=workdir / "shim.port", status_path=status_file, flush_on_exit=False)
        shim = shim_service(cfg, workdir / "shim.json", self.key, log=workdir / "shim.log", env=os.environ | env,
                            module=("harness.sandbox", "shim"), timeout_s=120, grace_s=60)
        with shim.start():
            self.shims.add(shim)
            heartbeat.beat("harness")
            agent_start = time.time()
            counts = agent(f"http://127.0.0.1:{shim.port}", token, job, self.max_tokens)
            agent_end = time.time()
            self.shims.discard(shim)
        status = json.loads(status_file.read_text())
        result = AttemptResult(
            ref=job.ref, harness=job.harness.name, pool=job.model.pool, model=job.model.model,
            outcome=HarnessOutcome.SUBMITTED if not counts["not_ok"] else HarnessOutcome.INFRA_ERROR,
            ledger_calls=int(status.get("ledger_rows", 0)), totals=Totals.model_validate(status.get("totals", {})),
            started_at=started, ended_at=utcnow())
        send_result(job.results_queue_url, result, unsent_rows(ledger, status), None, sign)
        heartbeat.finish(result.outcome.value)
        return counts | {"agent_start": agent_start, "agent_end": agent_end}


class AgentLauncher(FleetLauncher):
    """Launches AgentFleet tasks; `tasks` collects each finished task's timing (AgentFleet reports)."""

    def __init__(self, upstream_key: str, workdir: Path, env: dict, max_tokens: int,
                 attempt_env: AttemptEnv = no_attempt_env):
        super().__init__(AgentFleet, {"upstream_key": upstream_key, "workdir": str(workdir),
                                      "max_tokens": max_tokens}, env, attempt_env)
        self.tasks: list[dict] = []

    def item(self, ref: AttemptRef, job_uri: str) -> tuple:
        return ref.instance_id, ref.attempt, job_uri, self.attempt_env(ref)

    def on_message(self, kind: str, body) -> None:
        if kind == "tasks":
            self.tasks += body
