"""One dispatcher run per harness, in task images on the docker launcher, against the provider simulator through the
shim, shared by every test of that harness (`harness_runs`, session scope) and covering the four cases at once:

  * the gold instance: look, apply the gold patch, finish -> submitted, RESOLVED;
  * the turn-cap instance: the gold patch, then never finishing -> max_turns_exceeded, patch kept, RESOLVED;
  * the attempt-cap instance: the same, each turn after the patch padded with long text -> budget_exceeded, patch
    kept, RESOLVED;
  * the whole run under 30% injected 429/529: the shim absorbs them (retries in the ledger), the harness sees none.

While it runs, every task container's harness process tree is traced from the host (strace on the task runner,
attached before it starts the harness): every connect/sendto it makes is recorded (tests/harnesses/egress_trace.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from simulator.action_formats.aider_udiff import STALE, file_sections

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
GOLD, TURN_CAP, COST_CAP = "evalplane__calc-2", "evalplane__textkit-1", "evalplane__textkit-3"
MAX_TURNS = 8
PAD_CHARS = 200_000  # about 50,000 output tokens a turn: a few such turns pass the attempt cap, plain ones never


@dataclass(frozen=True)
class Case:
    provider: str
    model: str
    attempt_usd: float  # above what MAX_TURNS plain turns cost this harness, below two padded ones
    max_turns: int = MAX_TURNS
    instances: dict | None = None  # the policy's script for some instances, where this harness needs its own
    gateway: bool = False  # through the gateway tier, which translates the harness's wire format to the model's


ROWS = {r["instance_id"]: r for r in map(json.loads, (SYNTHETIC / "instances.jsonl").read_text().splitlines()) if r}


def with_stale_hunk(patch: str, stale_lines: int) -> str:
    """The patch and, after it, a hunk on its first file that applies nowhere (Aider's cap instances: a run of
    Aider's goes on only while it has something to reflect on)."""
    path = file_sections(patch)[0][0]
    return patch + f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,1 +1,1 @@\n" + STALE * stale_lines


CASES = {
    # three harnesses on a model of another provider, through the gateway: Claude Code (Anthropic's messages) on an
    # OpenAI model, Codex (OpenAI's Responses) and mini-swe-agent on an Anthropic one
    "mini-swe-agent": Case("anthropic", "claude-haiku-4-5", 0.3, gateway=True),
    "claude-code": Case("openai", "gpt-4o-mini", 0.05, gateway=True),
    "codex": Case("anthropic", "claude-haiku-4-5", 0.3, gateway=True),
    "opencode": Case("openai", "gpt-4o-mini", 0.08),
    # Aider reflects at most three times a run: its cap instances answer with the gold patch plus a hunk that cannot
    # apply, so it asks again until a cap refuses the call (tests/harnesses/test_aider.py)
    "aider": Case("openai", "gpt-4o-mini", attempt_usd=0.02, max_turns=3, instances={
        TURN_CAP: {"action": "patch", "patch": with_stale_hunk(ROWS[TURN_CAP]["patch"], 1), "keep_going": True},
        COST_CAP: {"action": "patch", "patch": with_stale_hunk(ROWS[COST_CAP]["patch"], 800), "keep_going": True},
    }),
    "openhands": Case("openai", "gpt-4o-mini", attempt_usd=0.08),
}
POLICY = {
    "default": {"action": "gold"},
    "instances": {TURN_CAP: {"action": "gold", "keep_going": True},
                  COST_CAP: {"action": "gold", "keep_going": True, "pad_chars": PAD_CHARS}},
}

SPEC = """
[run]
name = "{run}"
[harness]
name = "{harness}"
[model]
provider = "{provider}"
model = "{model}"
max_tokens = 1024
[instances]
dataset = "{synthetic}/instances.jsonl"
repos = "{synthetic}/repos"
ids = ["{gold}", "{turn_cap}", "{cost_cap}"]
[budget]
run_usd = 5.0
attempt_usd = {attempt_usd}
max_turns = {max_turns}
wall_time_s = 600
[backend]
kind = "local"
concurrency = 3
launcher = "docker"
[eval]
backend = "docker"
workers = 1
timeout_s = 300
[simulator]
policy = "{policy}"
error_rate = 0.3
error_statuses = [429, 529]
seed = 4  # its dice fail the run's first call, then about one in three: a run of any length sees faults
"""


@pytest.fixture(scope="session")
def instance_images(docker_engine):
    """A Docker engine, its base images, and the synthetic instances' SWE-bench-shaped images (built once, cached)."""
    p = subprocess.run([sys.executable, str(ROOT / "images/swebench/build.py"), "--dataset",
                        str(SYNTHETIC / "instances.jsonl")], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return docker_engine


@dataclass
class HarnessRun:
    harness: str
    run: str
    case: Case
    wall_s: float
    stdout: str
    stderr: str
    attempts: dict[str, dict]  # by instance id
    calls: dict[str, list[dict]]  # by instance id, in order
    trajectories: dict[str, dict]
    traces: dict[str, object] = field(default_factory=dict)  # by instance id: egress_trace.Trace
    shim_logs: dict[str, str] = field(default_factory=dict)  # by instance id: what its shim logged (its tail)

    def shim_complaints(self) -> list[str]:
        """The shims' warnings and errors, to say why a call failed."""
        return [f"{iid}: {line}" for iid, text in self.shim_logs.items() for line in text.splitlines()
                if " WARNING " in line or " ERROR " in line]


def _network_down(name: str) -> None:
    import docker

    from plumbing.egress import Egress

    Egress(docker.from_env(), name, [], "unused").down()


def harness_run(harness: str, tmp: Path, database_url: str, valkey_url: str, moto_endpoint: str) -> HarnessRun:
    from tests.harnesses.egress_trace import Tracer

    case = CASES[harness]
    run = f"h-{harness}-{uuid.uuid4().hex[:6]}"[:40]
    policy = POLICY | {"instances": POLICY["instances"] | (case.instances or {})}
    (tmp / "policy.json").write_text(json.dumps(policy))
    spec = tmp / "spec.toml"
    spec.write_text(SPEC.format(run=run, harness=harness, provider=case.provider, model=case.model,
                                synthetic=SYNTHETIC, gold=GOLD, turn_cap=TURN_CAP, cost_cap=COST_CAP,
                                attempt_usd=case.attempt_usd, max_turns=case.max_turns, policy=tmp / "policy.json")
                    + ("[gateway]\n" if case.gateway else ""))
    env = os.environ | {"DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "AWS_ENDPOINT_URL": moto_endpoint,
                        "EVALPLANE_STATE_DIR": str(tmp / "state"), "RAY_USAGE_STATS_ENABLED": "0",
                        # a network and egress of this run's own: other runs on the engine replace the shared one's routes
                        "EVALPLANE_TASK_NETWORK": f"ep-{run}"[:40]}
    # the task images first (the run would build them too; apart, the run's wall time is the run's alone)
    built = subprocess.run([sys.executable, "-m", "dispatcher", "images", str(spec)], env=env, capture_output=True,
                           text=True, cwd=ROOT, timeout=2400, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    tracer = Tracer(run, tmp / "traces").start()
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "dispatcher", "run", str(spec), "--out", str(tmp / "out")], env=env,
                           capture_output=True, text=True, cwd=ROOT, timeout=1500, check=False)
    finally:
        traces = tracer.stop()
        _network_down(f"ep-{run}"[:40])
        if case.gateway:
            from gateway import tier

            tier.stop(tmp / "state")  # the run's tier outlives its driver (a daemon of the state folder)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    import psycopg

    from contract import aws

    with psycopg.connect(database_url) as conn:
        cur = conn.execute("SELECT * FROM attempts WHERE run = %s", (run,))
        cols = [d.name for d in cur.description]
        attempts = {r["instance_id"]: r for r in (dict(zip(cols, row)) for row in cur.fetchall())}
        cur = conn.execute("SELECT * FROM calls WHERE run = %s ORDER BY instance_id, seq", (run,))
        cols = [d.name for d in cur.description]
        calls: dict[str, list[dict]] = {}
        for row in cur.fetchall():
            r = dict(zip(cols, row))
            calls.setdefault(r["instance_id"], []).append(r)
    os.environ.setdefault("AWS_ENDPOINT_URL", moto_endpoint)
    trajectories = {iid: json.loads(aws.get_text(a["trajectory_uri"])) for iid, a in attempts.items()
                    if a.get("trajectory_uri")}
    shim_logs = {}
    for iid, a in attempts.items():
        if uri := a.get("patch_uri") or a.get("trajectory_uri"):
            try:
                shim_logs[iid] = aws.get_text(uri.rsplit("/", 1)[0] + "/shim.log")
            except Exception as e:  # noqa: BLE001 - a diagnostic only
                shim_logs[iid] = f"(no shim log: {type(e).__name__})"
    print(f"\n{harness}: dispatcher run {wall:.1f} s; images: {built.stdout.strip().splitlines()[-1]}")
    return HarnessRun(harness, run, case, wall, p.stdout, p.stderr, attempts, calls, trajectories, traces,
                      shim_logs)



@pytest.fixture(scope="session")
def harness_runs(instance_images, tmp_path_factory, database_url, valkey_url, moto_endpoint):
    """harness name -> its one dispatcher run, made when a test first asks for it and shared by every test after."""
    runs: dict[str, HarnessRun] = {}

    def run_of(harness: str) -> HarnessRun:
        if harness not in runs:
            runs[harness] = harness_run(harness, tmp_path_factory.mktemp(harness), database_url, valkey_url,
                                        moto_endpoint)
        return runs[harness]

    return run_of
