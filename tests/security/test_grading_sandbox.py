"""The process grading backend runs the eval script (and so the model's code) as evalplane-grader in namespaces of
its own: no other process, no network, nothing of the state folder or the project, no write outside its sandbox.
Needs root (what the backend needs); under CI a non-root runner fails, never skips."""

from __future__ import annotations

import ast
import json
import os
import pwd
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eval_worker.environments import state_dir
from eval_worker.process_grader import ProcessGrader
from eval_worker.sandbox import GRADER_USER
from harness.sandbox import AGENT_USER

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
ACTIVATE = "source /opt/miniconda3/bin/activate && conda activate testbed"
LOOK = r"""
import json, os, socket, sys
out = {"uid": os.getuid(), "euid": os.geteuid(), "groups": os.getgroups(),
       "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
def attempt(label, fn):
    try:
        out[label] = "ok: " + str(fn())[:80]
    except Exception as e:
        out[label] = type(e).__name__
attempt("postgres", lambda: socket.create_connection(("127.0.0.1", 5432), timeout=3))
attempt("host address", lambda: socket.create_connection((sys.argv[1], 5432), timeout=3))
attempt("dns", lambda: socket.getaddrinfo("evalplane-exfil.invalid", 80))
for name, path in json.loads(sys.argv[2]).items():
    attempt("read " + name, lambda p=path: os.listdir(p) if os.path.isdir(p) else open(p, "rb").read(16))
    attempt("write " + name, lambda p=path: open(os.path.join(p if os.path.isdir(p) else os.path.dirname(p),
                                                              "evalplane-grading-probe"), "w").write("x"))
attempt("read pid 1 environ", lambda: open("/proc/1/environ", "rb").read())
print("LOOKED " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    from tests.tiers import unavailable

    if os.geteuid() != 0:
        unavailable("root", "the process grading backend needs root")
    row = next(json.loads(x) for x in (SYNTHETIC / "instances.jsonl").read_text().splitlines()
               if json.loads(x)["instance_id"] == "evalplane__calc-1")
    sb = ProcessGrader(root=tmp_path_factory.mktemp("grading-sandboxes")).create(
        instance=row, repo_source=str(SYNTHETIC / "repos" / "evalplane__calc.bundle"))
    yield sb
    sb.close()


def host_address() -> str:
    """An address of this host other than loopback (where its services would answer from outside)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        return s.getsockname()[0]


def test_the_eval_runs_as_the_grader_alone_with_no_network_and_nothing_of_ours(sandbox):
    canary = state_dir() / "keys" / f"grading-test-{os.getpid()}.key"  # a secret of the state folder's
    canary.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    canary.write_text("EPCANARY" + os.urandom(16).hex())
    places = {"state key": str(canary), "state folder": str(state_dir()), "project source": str(ROOT / "eval_worker"),
              "worker interpreter": sys.prefix, "host tmp": "/tmp", "etc": "/etc/passwd"}
    script = sandbox.root / "look.py"
    script.write_text(LOOK)
    os.chmod(script, 0o644)
    try:
        r = sandbox.exec(f"{ACTIVATE} && id && ls /proc && python {script} {host_address()} "
                         f"{shlex.quote(json.dumps(places))}")
    finally:
        canary.unlink()
    assert r.exit_code == 0, r.output
    seen = json.loads(r.output.split("LOOKED ", 1)[1])
    grader, agent = pwd.getpwnam(GRADER_USER), pwd.getpwnam(AGENT_USER) if _exists(AGENT_USER) else None
    assert seen["uid"] == seen["euid"] == grader.pw_uid != 0 and set(seen["groups"]) <= {grader.pw_gid}
    assert agent is None or seen["uid"] != agent.pw_uid
    assert f"uid={grader.pw_uid}({GRADER_USER})" in r.output  # the script's own `id`
    # its own PID namespace: a handful of processes (bwrap's init, the shell, python), none of this host's
    assert len(seen["pids"]) <= 6 and os.getpid() not in seen["pids"], seen["pids"]
    assert seen["read pid 1 environ"] == "PermissionError"
    # no network: PostgreSQL on loopback refuses (its own loopback), the host's address and names are unreachable
    for k in ("postgres", "host address", "dns"):
        assert not seen[k].startswith("ok"), (k, seen[k])
    # nothing of the state folder but the way to the grading's environment, nothing of the project or the worker's
    # interpreter; /tmp is a private one
    for name in ("state key", "project source", "worker interpreter"):
        assert seen[f"read {name}"] in ("FileNotFoundError", "PermissionError"), (name, seen[f"read {name}"])
        assert not seen[f"write {name}"].startswith("ok"), name
    listed = ast.literal_eval(seen["read state folder"].removeprefix("ok: "))
    assert set(listed) <= {"grading-envs", "wheels"}, listed
    assert not seen["write state folder"].startswith("ok")
    assert seen["read etc"].startswith("ok") and not seen["write etc"].startswith("ok")  # /etc: read-only
    assert seen["write host tmp"].startswith("ok")  # its own /tmp ...
    assert not Path("/tmp/evalplane-grading-probe").exists()  # ... which is not this host's


def _exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


def test_a_worker_that_cannot_confine_the_eval_refuses_to_start_naming_why(sandbox):
    from dispatcher.launchers.process import ensure_agent_user

    agent = ensure_agent_user()  # any user but root: the agent's is at hand
    p = subprocess.run(agent.argv([sys.executable, "-m", "eval_worker", "--queue", "http://sqs.example.invalid/q",
                                   "--backend", "process"], ROOT), cwd="/", capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"}, timeout=60, check=False)
    assert p.returncode == 2, p.stderr
    assert "--backend process:" in p.stderr and "needs root" in p.stderr and "docker" in p.stderr, p.stderr
