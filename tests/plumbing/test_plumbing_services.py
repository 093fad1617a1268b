"""plumbing.services.Service with real child processes: ready by a port file, a TCP port or a check; a start that
fails says why with the log's tail and leaves nothing running; stop escalates to SIGKILL and reaches the whole group
of a new session; a detached service is stopped from its pidfile only while its pid still runs it. And the one TCP
relay (plumbing.relay): bytes both ways, a half-close passed through, a listener made elsewhere served."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from plumbing import relay
from plumbing.services import Service, ServiceFailed, recorded_pid, stop_recorded, tcp_answers
from tests.conftest import free_port


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def listener(port_file: Path | None = None, port: int = 0) -> str:
    """A child that listens on loopback, writes its port (atomically) when given a file, and serves until killed."""
    return f"""
        import os, socket, time
        s = socket.socket(); s.bind(("127.0.0.1", {port})); s.listen()
        if {str(port_file)!r} != "None":
            open({str(port_file)!r} + ".tmp", "w").write(str(s.getsockname()[1]))
            os.replace({str(port_file)!r} + ".tmp", {str(port_file)!r})
        while True:
            time.sleep(1)
    """


def test_ready_by_port_file_then_stopped_by_sigterm(tmp_path):
    port_file = tmp_path / "port"
    port_file.write_text("1")  # a stale file from an earlier start never counts
    with Service(py(listener(port_file)), log=tmp_path / "svc.log", ready_file=port_file) as svc:
        assert svc.port != 1 and tcp_answers("127.0.0.1", svc.port)
        pid = svc.pid
    assert svc.proc.returncode == -signal.SIGTERM and not alive(pid)


def test_ready_by_tcp_and_by_a_check(tmp_path):
    port = free_port()
    with Service(py(listener(port=port)), tcp=("127.0.0.1", port)) as svc:
        assert svc.port == port and svc.running()
    calls = []
    with Service(py("import time; time.sleep(60)"), ready=lambda: calls.append(1) or len(calls) >= 3) as svc:
        assert len(calls) == 3 and svc.running()


def test_a_child_that_exits_fails_the_start_with_its_log_tail(tmp_path):
    log = tmp_path / "svc.log"
    svc = Service(py("import sys; print('boom: no config'); sys.exit(3)"), name="the widget", log=log,
                  ready_file=tmp_path / "port")
    with pytest.raises(ServiceFailed) as e:
        svc.start()
    msg = str(e.value)
    assert msg.startswith("the widget did not start: it exited with code 3") and str(log) in msg
    assert msg.rstrip().endswith("boom: no config")


def test_a_child_never_ready_is_stopped_at_the_timeout(tmp_path):
    svc = Service(py("import time; time.sleep(60)"), ready_file=tmp_path / "port", timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ServiceFailed, match=r"was not ready within 0.5 s"):
        svc.start()
    assert time.monotonic() - t0 < 5 and svc.proc.returncode == -signal.SIGTERM


def test_stop_escalates_to_sigkill_after_the_grace(tmp_path):
    ignores = py("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(__import__("sys").argv[1], "w").write("up")
        time.sleep(60)
    """)
    ready = tmp_path / "ready"
    svc = Service([*ignores, str(ready)], ready_file=ready, grace_s=0.5).start()
    t0 = time.monotonic()
    assert svc.stop() == -signal.SIGKILL and 0.4 < time.monotonic() - t0 < 5


def test_a_new_session_is_stopped_as_a_group(tmp_path):
    """What the service started (a worker of its own) goes with it."""
    grandchild = tmp_path / "grandchild.pid"
    parent = py(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(grandchild)!r}, "w").write(str(p.pid))
        time.sleep(60)
    """)
    svc = Service(parent, ready_file=grandchild, new_session=True).start()
    pid = int(grandchild.read_text())
    assert os.getpgid(pid) == svc.pid
    svc.stop()
    assert wait_gone(pid)


def test_a_detached_service_is_stopped_from_its_pidfile_only_while_the_pid_runs_it(tmp_path):
    pidfile = tmp_path / "svc.pid"
    port = free_port()
    Service(py(listener(port=port)), tcp=("127.0.0.1", port), new_session=True, pidfile=pidfile).start()
    pid = json.loads(pidfile.read_text())["pid"]
    assert recorded_pid(pidfile) == pid
    assert stop_recorded(pidfile) and not pidfile.exists()
    assert wait_gone(pid) and not stop_recorded(pidfile)
    # a record whose pid now runs something else (the pid was given to another process): left alone
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        pidfile.write_text(json.dumps({"pid": other.pid, "argv": ["something", "else"]}))
        assert recorded_pid(pidfile) is None and stop_recorded(pidfile)
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------ the relay


def echo_upstream() -> tuple[socket.socket, threading.Thread]:
    """An upstream that echoes what it reads and, at the client's end of file, says "bye" and closes."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)
            conn.sendall(b"bye")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv, t


def read_all(s: socket.socket) -> bytes:
    out = b""
    while data := s.recv(65536):
        out += data
    return out


def test_the_relay_carries_both_ways_and_passes_a_half_close():
    upstream, _ = echo_upstream()
    port = free_port()
    r = relay.Relay([("127.0.0.1", port, "127.0.0.1", upstream.getsockname()[1])])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"x" * 200_000)
            c.shutdown(socket.SHUT_WR)  # done sending: the answer still comes back
            assert read_all(c) == b"x" * 200_000 + b"bye"
    finally:
        r.close()
        upstream.close()


def test_the_relay_serves_a_listener_made_elsewhere():
    """As the agent's sandbox uses it: the listener bound first (in the agent's namespace), served later."""
    upstream, _ = echo_upstream()
    lsock = socket.create_server(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    task = loop.create_task(relay.serve_listener(lsock, "127.0.0.1", upstream.getsockname()[1]))

    def serve():
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with socket.create_connection(lsock.getsockname(), timeout=10) as c:
            c.sendall(b"hello")
            c.shutdown(socket.SHUT_WR)
            assert read_all(c) == b"hellobye"
    finally:
        loop.call_soon_threadsafe(task.cancel)
        t.join(5)
        loop.close()
        upstream.close()
