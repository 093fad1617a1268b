"""A child service: start a process, wait until it serves, stop it (SIGTERM, then SIGKILL after a grace).

Every long-running helper process of the project (the shim, the provider simulator, moto's S3/SQS server, the
package index, eval workers, LiteLLM in the benchmarks) starts through Service, so that readiness, the error that
says why one did not start (with its log's tail) and the way it is stopped are written once.

Readiness is one of: a file the child writes once it listens (its port file; ready when non-empty, read back as
`ready_text`), a TCP address accepting connections, or any check the caller passes (an HTTP health route).

Detached services (the local backend's daemons and per-run services) outlive the process that started them: start
them with new_session=True and a pidfile, drop the Service, and stop them later from any process with
stop_recorded(pidfile), which checks the pid still runs the recorded command line before it signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self

LOG_TAIL_BYTES = 2000


class ServiceFailed(RuntimeError):
    """The service exited or was not ready in time (it has been stopped); the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the caller binds it soon after: another process may take it in between)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def log_tail(path: Path | None, limit: int = LOG_TAIL_BYTES) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def terminate(proc: subprocess.Popen, grace_s: float, *, group: bool = False, sig: int = signal.SIGTERM) -> int:
    """`sig` to the process (with group, to its whole process group), SIGKILL after grace_s; returns its exit
    code. With group, what the leader left in its group is killed too when the grace runs out."""

    def send(s: int) -> None:
        try:
            os.killpg(proc.pid, s) if group else proc.send_signal(s)
        except ProcessLookupError:
            pass

    if proc.poll() is None:
        send(sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()
    return proc.returncode


class Service:
    """argv as a child process, its stdout and stderr appended to `log` (discarded without one), stdin closed.

    ready_file: ready once the child has written it (non-empty; removed before the start, so a stale one never
    counts); tcp: ready once (host, port) accepts connections; ready: ready once it returns true. None of them:
    ready as soon as it runs. new_session: the child leads a process group of its own (a terminal's Ctrl-C or the
    parent's group kill does not reach it) and stop() signals that whole group. pidfile: {"pid", "argv"} written
    at the start, for stop_recorded() from another process. Use as a context manager, or start() and stop()."""

    def __init__(self, argv: Sequence[str | os.PathLike], *, name: str | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None, log: Path | None = None,
                 ready_file: Path | None = None, tcp: tuple[str, int] | None = None,
                 ready: Callable[[], bool] | None = None, timeout_s: float | None = 30.0, grace_s: float = 10.0,
                 poll_s: float = 0.02, new_session: bool = False, pidfile: Path | None = None,
                 popen_kwargs: Mapping | None = None):
        self.argv = [os.fspath(a) for a in argv]
        self.name = name or (self.argv[2] if self.argv[1:2] == ["-m"] and len(self.argv) > 2 else Path(self.argv[0]).name)
        self.env, self.cwd, self.log = (dict(env) if env is not None else None), cwd, log
        self.ready_file, self.tcp, self.ready = ready_file, tcp, ready
        self.timeout_s, self.grace_s, self.poll_s = timeout_s, grace_s, poll_s
        self.new_session, self.pidfile, self.popen_kwargs = new_session, pidfile, dict(popen_kwargs or {})
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ start
    def spawn(self) -> Self:
        """Start the process without waiting for it to be ready (wait_ready() does)."""
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        with contextlib.ExitStack() as files:
            out = subprocess.DEVNULL
            if self.log is not None:  # the child keeps its own copy of the descriptor
                out = files.enter_context(open(self.log, "ab"))
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=self.new_session, **self.popen_kwargs)
        if self.pidfile is not None:
            self.pidfile.write_text(json.dumps({"pid": self.proc.pid, "argv": self.argv}))
        return self

    def is_ready(self) -> bool:
        if self.ready_file is not None and not self.ready_text:
            return False
        if self.tcp is not None and not tcp_answers(*self.tcp):
            return False
        return self.ready is None or bool(self.ready())

    def wait_ready(self, timeout_s: float | None = None) -> Self:
        """Wait until the service is ready; if it exits first or the timeout runs out (None: no timeout), stop it
        and raise ServiceFailed."""
        assert self.proc is not None, "spawn() first"
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not self.is_ready():
                if self.proc.poll() is not None:
                    self._failed(f"it exited with code {self.proc.returncode}")
                if deadline is not None and time.monotonic() > deadline:
                    self._failed(f"it was not ready within {timeout_s:g} s")
                time.sleep(self.poll_s)
        except BaseException:  # a signal's exception (the task runner's SIGTERM) included: leave nothing running
            self.stop()
            raise
        return self

    def start(self, timeout_s: float | None = None) -> Self:
        return self.spawn().wait_ready(timeout_s)

    def _failed(self, why: str) -> None:
        self.stop()
        where = f"; {self.log} ends with:\n{log_tail(self.log)}" if self.log is not None else ""
        raise ServiceFailed(f"{self.name} did not start: {why}{where}")

    # ------------------------------------------------------------------ what it serves
    @property
    def ready_text(self) -> str:
        """The ready file's content, stripped ('' while there is none)."""
        try:
            return self.ready_file.read_text().strip() if self.ready_file is not None else ""
        except OSError:
            return ""

    @property
    def port(self) -> int:
        """The port it listens on: the tcp address's, or the one its ready file names."""
        return self.tcp[1] if self.tcp is not None else int(self.ready_text)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------------ stop
    def stop(self, sig: int = signal.SIGTERM, grace_s: float | None = None) -> int | None:
        """`sig` (SIGTERM: the service finishes what it has and exits), SIGKILL after the grace; its exit code
        (None if it never started)."""
        if self.proc is None:
            return None
        code = terminate(self.proc, self.grace_s if grace_s is None else grace_s, group=self.new_session, sig=sig)
        if self.pidfile is not None:
            self.pidfile.unlink(missing_ok=True)
        return code

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def recorded_pid(pidfile: Path) -> int | None:
    """The pid in a service's pidfile if that process still runs the recorded command line (a pid the system has
    since given to another process is not ours to signal), else None."""
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    if isinstance(rec, int):  # a bare pid, as daemons recorded before Service: nothing to check it against
        return rec
    cmdline = _cmdline(rec["pid"])
    if cmdline is None:
        return None
    if "argv" in rec:
        return rec["pid"] if cmdline == rec["argv"] else None
    return rec["pid"] if rec.get("module") in cmdline else None  # local services' earlier records


def stop_recorded(pidfile: Path, sig: int = signal.SIGTERM) -> bool:
    """Signal the process group of the detached service recorded in pidfile (if it still runs it) and remove the
    record, without waiting for it to exit. False if there was no record."""
    if not pidfile.exists():
        return False
    pid = recorded_pid(pidfile)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
    pidfile.unlink(missing_ok=True)
    return True
