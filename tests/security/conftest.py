"""One red-team run and one honest run per launcher (process, docker), shared by this folder's tests.

Both runs attempt one synthetic instance through the gateway tier against a provider simulator this module starts
(model.base_url), whose key, like the run's AWS credentials and the gateway's admin key, is a canary: `EPCANARY` + 32 hex digits, unique to the session, so that a scan for
that shape finds secrets exactly. The red-team run's simulator attacks the task first (simulator/red_team.py), then
applies the same patch as the honest run: a wrong fix, the attack's conftest.py and its grading probe (the package's
__init__.py gains code that, when grading's tests import it, probes what grading lets it see).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

from contract.aws import eval_logs_prefix
from plumbing.services import Service
from simulator import red_team
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
INSTANCE = "evalplane__calc-1"
CANARY = re.compile(red_team.CANARY_PATTERN)
ATTACK_LINE = re.compile(r"^ATTACK (\w+): (\{.*\})$", re.MULTILINE)


def canary() -> str:
    return "EPCANARY" + secrets.token_hex(16)


def instance_row() -> dict:
    rows = [json.loads(x) for x in (SYNTHETIC / "instances.jsonl").read_text().splitlines() if x.strip()]
    return next(r for r in rows if r["instance_id"] == INSTANCE)


def wrong_fix() -> str:
    """The demo's wrong fix for the instance."""
    return json.loads((SYNTHETIC / "demo_policy.json").read_text())["instances"][INSTANCE]["patch"]


def host_address() -> str:
    """An address of this host other than loopback (where its services would answer from outside)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        return s.getsockname()[0]


def grading_intel(env: dict, launcher: str) -> dict:
    """What the grading probe tries (the same for the red-team and the honest run of a launcher, so that their trees
    are the same): the services of this host by every address grading could reach them at, the state folder's
    secrets, the folders it would write in (each must stay without its marker file on this host)."""
    from dispatcher.backends import daemons

    hosts = ["127.0.0.1", host_address()]
    if launcher == "docker":
        import docker

        from dispatcher.launchers.docker import task_network
        from plumbing.egress import bridge_gateway

        hosts += [bridge_gateway(docker.from_env()), task_network() + "-egress"]  # the tasks' relays listen there
    state = env["EVALPLANE_STATE_DIR"]
    ports = [["postgres", urlsplit(env["DATABASE_URL"]).port or 5432], ["valkey", urlsplit(env["VALKEY_URL"]).port],
             ["s3-sqs", urlsplit(env["AWS_ENDPOINT_URL"]).port], ["package-index", daemons.INDEX_PORT]]
    return {"canary": red_team.CANARY_PATTERN, "hosts": hosts, "ports": ports,
            "secrets": [str(Path(state) / "keys" / "verdict.key"), "/proc/1/environ"],
            "scan": [state, str(ROOT), "/root"], "write": [state, str(ROOT), "/tmp", "/"],
            "marker": f"evalplane-grading-probe-{launcher}"}


def honest_patch(intel: dict, tmp: Path) -> str:
    """The red team's final tree as one patch: the wrong fix, the conftest.py and the grading probe."""
    repo = tmp / "honest-tree"
    env = os.environ | {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

    def git(*args, **kw):
        return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True, **kw)

    subprocess.run(["git", "clone", "-q", str(SYNTHETIC / "repos" / "evalplane__calc.bundle"), str(repo)], env=env,
                   check=True)
    git("checkout", "-q", instance_row()["base_commit"])
    (repo / "conftest.py").write_text(red_team.CONFTEST)
    red_team.plant_grading_probe(str(repo), intel)
    git("apply", "-", input=wrong_fix())
    git("add", "-A")
    return git("diff", "--cached", "--binary", instance_row()["base_commit"]).stdout


class Simulator:
    def __init__(self, tmp: Path, key: str, policy: Path, dataset: Path, intel: Path | None, port: int):
        port_file = tmp / "sim.port"
        argv = [sys.executable, "-m", "simulator", "--port", str(port), "--port-file", str(port_file), "--policy",
                str(policy), "--dataset", str(dataset)] + (["--red-team", str(intel)] if intel else [])
        self.service = Service(argv, name="the simulator", env=os.environ | {"SIMULATOR_API_KEY": key}, cwd=ROOT,
                               log=tmp / "sim.log", ready_file=port_file, timeout_s=30, poll_s=0.05).start()
        self.proc = self.service.proc
        self.port = self.service.port
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.service.stop()


class BudgetWatch:
    """The run's budget hash in Valkey, sampled while the run goes (the run's end removes its keys)."""

    def __init__(self, valkey, run: str):
        from contract import keys

        self.valkey, self.key, self.last, self._stop = valkey, keys.run_budget(run), {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.wait(0.3):
            got = self.valkey.hgetall(self.key)
            if got:
                self.last = {k.decode(): v.decode() for k, v in got.items()}

    def stop(self) -> dict:
        self._stop.set()
        self.thread.join()
        return self.last


def spec_text(run: str, launcher: str, sim_url: str, dataset: Path) -> str:
    return f"""
[run]
name = "{run}"
attempts = 1

[harness]
name = "mini-swe-agent"

[model]
provider = "openai"
model = "gpt-4o-mini"
base_url = "{sim_url}"
api_key_env = "EVALPLANE_UPSTREAM_KEY"
max_tokens = 1024

[instances]
dataset = "{dataset}"
repos = "{SYNTHETIC / 'repos'}"

[budget]
run_usd = 2.0
attempt_usd = 0.5
max_turns = {len(red_team.ATTACKS) + 6}
wall_time_s = 900

[backend]
kind = "local"
concurrency = 1
launcher = "{launcher}"

[eval]
backend = "{launcher}"
workers = 1
timeout_s = 300

[gateway]
"""


def attacks_of(trajectory: dict) -> dict[str, dict]:
    """Each attack's findings, from the observations the harness recorded."""
    found = {}
    for m in trajectory.get("messages", []):
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        for name, body in ATTACK_LINE.findall(text.replace("\\n", "\n")):
            try:
                found[name] = json.loads(body)
            except ValueError:
                found[name] = {"unparsed": body}
    return found


def run_once(tmp: Path, launcher: str, red: bool, base_env: dict, database_url: str, valkey) -> dict:
    """One run of the instance; returns what it left: rows, ledger, spend, report, patch, trajectory, budget."""
    import boto3

    run = f"sec{launcher[0]}{'r' if red else 'h'}{secrets.token_hex(4)}"
    tmp.mkdir(parents=True, exist_ok=True)
    dataset = tmp / "one.jsonl"
    dataset.write_text(json.dumps(instance_row()) + "\n")
    policy = tmp / "policy.json"
    # the red team writes conftest.py and the grading probe itself (attacks), then applies the wrong fix: both trees
    # end up the same
    grading = grading_intel(base_env, launcher)
    patch = wrong_fix() if red else honest_patch(grading, tmp)
    policy.write_text(json.dumps({"instances": {INSTANCE: {"action": "patch", "patch": patch}}}))
    key = base_env["EVALPLANE_UPSTREAM_KEY"]
    secrets_of_run = plant_keys(base_env, run)
    intel, port = None, free_port()
    if red:
        valkey_port = urlsplit(base_env["VALKEY_URL"]).port or 6379
        aws_port = urlsplit(base_env["AWS_ENDPOINT_URL"]).port
        from dispatcher.launchers.docker import task_network

        egress = task_network() + "-egress"  # the docker launcher's network's one peer, by its name
        hosts = ["127.0.0.1"] if launcher == "process" else [egress]
        intel = tmp / "intel.json"
        intel_doc = {"run": run, "hosts": hosts, "valkey_port": valkey_port, "aws_port": aws_port,
                     "queues": [f"ep-{run}-results", f"ep-{run}-eval", f"ep-{run}-verdicts"],
                     "state_dirs": [base_env["EVALPLANE_STATE_DIR"]], "upstream_hosts": hosts, "upstream_port": port,
                     "pool": "gpt-4o-mini@mini-swe-agent", "scan_s": 20,
                     "digests": {hashlib.sha256(v.encode()).hexdigest(): k for k, v in secrets_of_run.items()},
                     "lengths": sorted({len(v) for v in secrets_of_run.values()}), "grading": grading}
        intel.write_text(json.dumps(intel_doc))
    sim = Simulator(tmp, key, policy, dataset, intel, port)
    spec = tmp / "spec.toml"
    spec.write_text(spec_text(run, launcher, sim.url, dataset))
    watch = BudgetWatch(valkey, run)
    try:
        for _ in range(4):  # Ray's node missed even that deadline: run again (the run resumes)
            p = subprocess.run([sys.executable, "-m", "dispatcher", "run", str(spec), "--out", str(tmp / "out")],
                               env=base_env, capture_output=True, text=True, timeout=2400, cwd=ROOT, check=False)
            if p.returncode == 0 or "node timed out during startup" not in p.stderr:
                break
    finally:
        budget = watch.stop()
        sim.stop()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    with psycopg.connect(database_url) as conn:
        conn.row_factory = psycopg.rows.dict_row
        attempt = conn.execute("SELECT * FROM attempts WHERE run = %s", (run,)).fetchone()
        calls = conn.execute("SELECT * FROM calls WHERE run = %s ORDER BY seq", (run,)).fetchall()
        phases = conn.execute("SELECT * FROM phases WHERE run = %s ORDER BY phase", (run,)).fetchall()
        run_row = conn.execute("SELECT * FROM runs WHERE run = %s", (run,)).fetchone()
    s3 = boto3.client("s3", endpoint_url=base_env["AWS_ENDPOINT_URL"], region_name="us-east-1")

    def fetch(uri):
        if not uri:
            return None
        bucket, _, k = uri.removeprefix("s3://").partition("/")
        return s3.get_object(Bucket=bucket, Key=k)["Body"].read().decode()

    trajectory = json.loads(fetch(attempt["trajectory_uri"]) or "{}")
    report = json.loads((tmp / "out" / f"gpt-4o-mini.{run}.json").read_text())
    test_output = fetch(eval_logs_prefix(attempt["patch_uri"].rsplit("/", 1)[0]) + "test_output.txt")
    left = sorted(k.decode() for k in valkey.scan_iter(match=f"ep:run:{{{run}}}:*"))
    return {"run": run, "launcher": launcher, "attempt": attempt, "calls": calls, "phases": phases, "run_row": run_row,
            "budget": budget, "patch": fetch(attempt["patch_uri"]), "trajectory": trajectory,
            "attacks": attacks_of(trajectory), "report": report, "valkey_left": left, "grading": grading,
            "probe": probe_of(test_output),
            "canaries": {k: base_env[k] for k in CANARY_ENV}, "secrets": secrets_of_run, "stderr": p.stderr}


def probe_of(test_output: str | None) -> dict | None:
    """The grading probe's findings, from the test output it printed them into."""
    lines = [ln for ln in (test_output or "").splitlines() if ln.startswith(red_team.PROBE_LINE)]
    return json.loads(lines[-1].removeprefix(red_team.PROBE_LINE)) if lines else None


CANARY_ENV = ("EVALPLANE_UPSTREAM_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _write_key(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)


def plant_keys(env: dict, run: str) -> dict[str, str]:
    """The run's secrets, known beforehand: the run secret, the verdict key and the gateway's admin (master) key as
    canaries in the 0600 files the dispatcher and the gateway tier make them in on first use (they use them as
    found), and what derives from them (the attempt's signing key, the run's Valkey password, the run's gateway
    key), with the admin Valkey password and the provider key (which only the gateway holds). Name -> value."""
    from contract import signing
    from contract.models import AttemptRef

    state = Path(env["EVALPLANE_STATE_DIR"])
    run_secret, verdict = canary(), canary()
    _write_key(state / "runs" / run / "run.key", run_secret)
    verdict_file = state / "keys" / "verdict.key"
    if verdict_file.exists():
        verdict = verdict_file.read_text().strip()
    else:
        _write_key(verdict_file, verdict)
    master_file = state / "gateway" / "master.key"
    master = master_file.read_text().strip() if master_file.exists() else "sk-" + canary()  # LiteLLM's shape
    if not master_file.exists():
        _write_key(master_file, master)
    ref = AttemptRef(run=run, instance_id=INSTANCE, attempt=1)
    return {"run secret": run_secret, "verdict key": verdict, "gateway master key": master,
            "gateway run key": signing.gateway_key(run_secret.encode()),
            "attempt key": signing.attempt_key(run_secret.encode(), ref).decode(),
            "valkey run password": signing.valkey_password(run_secret.encode()),
            "valkey admin password": urlsplit(env["VALKEY_URL"]).password or "",
            "provider key": env["EVALPLANE_UPSTREAM_KEY"], "aws secret": env["AWS_SECRET_ACCESS_KEY"]}


@pytest.fixture(scope="session")
def security_env(database_url, valkey_url, moto_endpoint, tmp_path_factory):
    """The dispatcher's environment with a canary for every secret it holds; the runs' gateway tier (a daemon of
    the state folder) stopped at the end."""
    from gateway import tier

    state = tmp_path_factory.mktemp("security-state")
    yield os.environ | {
        "DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "AWS_ENDPOINT_URL": moto_endpoint,
        "EVALPLANE_STATE_DIR": str(state), "RAY_USAGE_STATS_ENABLED": "0",
    } | RAY_ENV | {k: canary() for k in CANARY_ENV}
    tier.stop(state)


@pytest.fixture(scope="session")
def valkey_session(valkey_url):
    import redis

    r = redis.Redis.from_url(valkey_url)
    yield r
    r.close()


# Ray's node start-up deadline (read when ray is imported), longer than its default 30 s: on a loaded machine the
# dispatcher's local Ray cluster can miss it
RAY_ENV = {"RAY_raylet_start_wait_time_s": "120"}


@pytest.fixture(scope="session")
def process_runs(security_env, database_url, valkey_session, tmp_path_factory):
    """(red team, honest) with the process launcher."""
    tmp = tmp_path_factory.mktemp("process-runs")
    red = run_once(tmp / "red", "process", True, security_env, database_url, valkey_session)
    honest = run_once(tmp / "honest", "process", False, security_env, database_url, valkey_session)
    return red, honest


@pytest.fixture(scope="session")
def docker_runs(docker_engine, security_env, database_url, valkey_session, tmp_path_factory):
    """(red team, honest) with the docker launcher: task images, the egress, docker grading."""
    p = subprocess.run([sys.executable, str(ROOT / "images/swebench/build.py"), "--dataset",
                        str(SYNTHETIC / "instances.jsonl")], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    tmp = tmp_path_factory.mktemp("docker-runs")
    red = run_once(tmp / "red", "docker", True, security_env, database_url, valkey_session)
    honest = run_once(tmp / "honest", "docker", False, security_env, database_url, valkey_session)
    return red, honest


@pytest.fixture(scope="session", params=["process", "docker"])
def runs(request):
    return request.getfixturevalue(f"{request.param}_runs")
