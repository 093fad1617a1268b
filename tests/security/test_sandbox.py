"""harness/sandbox.py on this host: the privilege drop, PR_SET_DUMPABLE, and the process launcher's refusal to run
an unisolated agent. Needs root (what the process launcher needs); under CI a non-root runner fails, never skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dispatcher.launchers.process import agent_isolation_problem, ensure_agent_user
from harness import sandbox

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agent() -> sandbox.Agent:
    from tests.tiers import unavailable

    if os.geteuid() != 0:
        unavailable("root", "the agent's sandbox needs root (the process launcher's task runner runs as root)")
    return ensure_agent_user()


def as_agent(agent: sandbox.Agent, code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(agent.argv([sys.executable, "-c", code], Path("/tmp")), cwd="/", capture_output=True,
                          text=True, env=env or {"PATH": "/usr/bin:/bin"}, timeout=60, check=False)


def sleeper(argv_prefix: list[str], env: dict) -> subprocess.Popen:
    """A process of the sandbox's module runner that stays up (a standard-library HTTP server on a free port)."""
    return subprocess.Popen([*argv_prefix, "-m", "harness.sandbox", "http.server", "0", "--bind", "127.0.0.1"],
                            env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_the_agent_runs_as_its_own_user_with_no_group_of_ours(agent):
    p = as_agent(agent, "import os, json; print(json.dumps([os.getuid(), os.geteuid(), os.getgid(), os.getgroups(),"
                        " oct(os.umask(0))]))")
    assert p.returncode == 0, p.stderr
    uid, euid, gid, groups, umask = json.loads(p.stdout)
    assert (uid, euid, gid) == (agent.uid, agent.uid, agent.gid) and uid != 0
    assert set(groups) <= {agent.gid} and umask == oct(sandbox.AGENT_UMASK)
    back = as_agent(agent, "import os; os.setuid(0)")
    assert back.returncode != 0 and "PermissionError" in back.stderr  # no way back


def test_undumpable_processes_are_closed_even_to_their_own_user(agent):
    secret = "EPCANARY" + os.urandom(16).hex()
    env = {"PATH": "/usr/bin:/bin", "SANDBOX_TEST_SECRET": secret}
    root_proc = sleeper([sys.executable], env)  # like the shim: root, undumpable
    agent_proc = subprocess.Popen(agent.argv([sys.executable, "-m", "harness.sandbox", "http.server", "0", "--bind",
                                              "127.0.0.1"], Path("/tmp")), env=env, cwd="/",
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        for pid in (root_proc.pid, agent_proc.pid):  # agent.argv execs in place: the pid is the agent's process
            p = as_agent(agent, f"open('/proc/{pid}/environ', 'rb').read()")
            assert p.returncode != 0 and "PermissionError" in p.stderr, (pid, p.stderr)
            p = as_agent(agent, f"open('/proc/{pid}/maps', 'rb').read()")
            assert p.returncode != 0 and "PermissionError" in p.stderr, (pid, p.stderr)
        # the control: a dumpable process of the agent's own is readable (the denial above is PR_SET_DUMPABLE's)
        p = as_agent(agent, "import subprocess, time; s = subprocess.Popen(['sleep', '5'], env={'X': 'y'}); "
                            "time.sleep(0.3); print(open('/proc/%d/environ' % s.pid, 'rb').read()); s.kill()")
        assert p.returncode == 0 and "X=y" in p.stdout, p.stderr
    finally:
        for proc in (root_proc, agent_proc):
            proc.kill()
            proc.wait()


def test_the_process_launcher_refuses_to_run_the_agent_unisolated_without_root(agent):
    code = ("from types import SimpleNamespace as N; from dispatcher.launchers.process import agent_isolation_problem"
            " as f; b = N(kind='local', launcher='process', isolate_agent=True); print(f(N(backend=b)));"
            " print(f(N(backend=N(kind='local', launcher='process', isolate_agent=False))))")
    p = subprocess.run(agent.argv([sys.executable, "-c", code], ROOT), cwd="/", capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"}, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    refused, opted_out = p.stdout.splitlines()
    assert refused.startswith("backend.isolate_agent:") and "root" in refused
    assert opted_out == "None"
    from types import SimpleNamespace as N

    assert agent_isolation_problem(N(backend=N(kind="local", launcher="process", isolate_agent=True))) is None


def test_on_a_host_the_agents_network_leads_only_to_the_shim(agent):
    """The process launcher's agent: loopback only, the shim's port relayed to the host's; PostgreSQL on the host's
    loopback, the metadata endpoint and any outside address lead nowhere."""
    import http.server
    import threading

    shim = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501 to GET
    threading.Thread(target=shim.serve_forever, daemon=True).start()
    port = shim.server_address[1]
    code = (f"import socket, urllib.request, urllib.error\n"
            f"try:\n    urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=10)\n"
            f"except urllib.error.HTTPError as e:\n    print('shim', e.code)\n"
            f"for h, p in (('127.0.0.1', 5432), ('169.254.169.254', 80), ('1.1.1.1', 443)):\n"
            f"    try:\n        socket.create_connection((h, p), timeout=3); print(h, 'connected')\n"
            f"    except OSError as e:\n        print(h, type(e).__name__)\n")
    try:
        p = subprocess.run(agent.argv([sys.executable, "-c", code], Path("/tmp"), relay_port=port), cwd="/",
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60, check=False)
    finally:
        shim.shutdown()
        for pid in _relays(port):  # this test's relay, left to the runner's reaping in a task
            os.kill(pid, 9)
    assert p.returncode == 0, p.stderr
    got = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert got["shim"] == "501", got
    assert got["127.0.0.1"] == "ConnectionRefusedError" and "connected" not in got.values(), got


def _relays(port: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.isdigit() and b"--relay" in argv and str(port).encode() in argv and b"harness.sandbox" in argv:
            found.append(int(entry))
    return found
