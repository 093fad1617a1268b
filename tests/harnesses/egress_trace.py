"""Every connection a harness's process tree attempts, recorded from the host while its task container runs.

The docker launcher's containers sit on an internal network whose only way out is the egress (dispatcher/launchers/
egress.py), so a harness calling home would fail there, but silently. Here each task container of a run is found
as it starts, and its task runner (the child of the container's init) is traced with `strace -f` before it starts
the harness (it first checks out /testbed and starts the shim): every execve, clone, bind, connect, sendto, sendmsg
and sendmmsg of it and of every process it starts afterwards. From the trace: the harness's tree (the process that
executed the harness's argv[0], and its descendants), the shim (the process that executed `-m shim`) and its port
(the loopback port the task runner itself connects to for the shim's status), and every internet-family destination the harness's tree tried, DNS queries included (a lookup is a connect
or a send to port 53).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

LINE = re.compile(r"^(\d+) +(.*)$")
EXECVE = re.compile(r'^execve\("([^"]+)", \[(.*?)\]')
# a child's pid as the tracee sees it, then (--decode-pids=pidns) as the host does: strace's line prefixes are the host's
CHILD = re.compile(r"(?:clone3?|v?fork)\b.*= (\d+)(?: /\* (\d+) in strace's PID NS \*/)?$")
INET = re.compile(r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\),.*?(?:inet_addr\(|inet_pton\(AF_INET6, )"([^"]+)"')
BIND = re.compile(r"^bind\(")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@dataclass
class Trace:
    container: str
    path: Path
    harness_exec: str | None = None  # argv[0] the harness tree started from
    shim_ports: set[int] = field(default_factory=set)
    destinations: list[tuple[int, str, int, str]] = field(default_factory=list)  # (pid, host, port, syscall line)

    @property
    def outside_shim(self) -> list[tuple[int, str, int, str]]:
        return [d for d in self.destinations if not (d[1] in LOOPBACK and d[2] in self.shim_ports)]


def parse(container: str, path: Path, is_harness) -> Trace:
    """is_harness(argv0, argv) says whether an execve starts the harness."""
    parent: dict[int, int] = {}
    harness_roots: set[int] = set()
    shim: set[int] = set()
    trace = Trace(container, path)
    events: list[tuple[int, str]] = []
    pending: dict[int, tuple[str, list[str]]] = {}
    for raw in path.read_text(errors="replace").splitlines():
        m = LINE.match(raw)
        if not m:
            continue
        pid, call = int(m[1]), m[2]
        events.append((pid, call))
        if (c := CHILD.search(call)) and int(c[1]) > 0:
            parent.setdefault(int(c[2] or c[1]), pid)
        if e := EXECVE.match(call):  # its result may come on a later line (`<... execve resumed>) = 0`)
            pending[pid] = (e[1], re.findall(r'"((?:[^"\\]|\\.)*)"', e[2]))
        if (call.startswith(("execve(", "<... execve resumed>"))) and call.rstrip().endswith("= 0") \
                and pid in pending:
            exe, argv = pending.pop(pid)
            if "-m" in argv and "shim" in argv:
                shim.add(pid)
            elif is_harness(exe, argv) and trace.harness_exec is None:
                harness_roots.add(pid)
                trace.harness_exec = exe

    def under(pid: int, roots: set[int]) -> bool:
        seen = set()
        while pid not in roots:
            if pid in seen or pid not in parent:
                return False
            seen.add(pid)
            pid = parent[pid]
        return True

    for pid, call in events:
        addr = INET.search(call)
        if not addr or BIND.match(call):
            continue
        if under(pid, harness_roots):
            trace.destinations.append((pid, addr[2], int(addr[1]), call[:200]))
        elif not under(pid, shim) and addr[2] in LOOPBACK:
            # the shim binds port 0; the task runner, which asks it for its status, connects to the port it got
            trace.shim_ports.add(int(addr[1]))
    return trace


class Tracer:
    """Attaches strace to each task container of `run` as it appears (a thread polling the engine)."""

    def __init__(self, run: str, out: Path):
        import docker

        self.client = docker.from_env()
        self.run, self.out = run, out
        self.out.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.files: dict[str, Path] = {}
        self.late: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self.strace = shutil.which("strace")
        if self.strace is None:
            raise RuntimeError("strace is needed on the host to record the harness's connections")

    def start(self) -> Tracer:
        self._thread.start()
        return self

    def _task_runner(self, init_pid: int) -> int | None:
        try:
            kids = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                found = self.client.containers.list(filters={"label": [f"evalplane.run={self.run}",
                                                                       "evalplane.role=task"]})
            except Exception:  # noqa: BLE001 - the engine is busy: look again
                found = []
            for c in found:
                iid = c.labels.get("evalplane.instance", c.id)
                if iid in self.procs:
                    continue
                try:
                    pid = self.client.api.inspect_container(c.id)["State"]["Pid"]
                except Exception:  # noqa: BLE001, S112 - gone already, or the engine is busy
                    continue
                runner = self._task_runner(pid) if pid else None
                if runner is None:
                    continue
                path = self.out / f"{iid}.strace"
                self.procs[iid] = subprocess.Popen(
                    [self.strace, "-f", "-qq", "--decode-pids=pidns", "-s", "256", "-o", str(path), "-e",
                     "trace=execve,clone,clone3,fork,vfork,bind,connect,sendto,sendmsg,sendmmsg", "-p", str(runner)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.files[iid] = path
            time.sleep(0.05)

    def stop(self) -> dict[str, Path]:
        self._stop.set()
        self._thread.join(timeout=10)
        for p in self.procs.values():
            try:
                p.wait(timeout=30)  # ends with the traced processes
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(timeout=10)
        return dict(self.files)
