"""The agent's user: the harness and everything it starts run as an unprivileged user of their own.

A task has two sides. The task runner and the shim (root in a task container; on the process launcher the
dispatcher's user) hold the secrets: the provider key, the Valkey credentials, the AWS credentials, the attempt's
signing key. The harness runs as AGENT_USER, another uid, so its commands cannot read the first side's
processes (/proc/<pid>/environ, mem, fd need the same uid; PR_SET_DUMPABLE=0 closes them to anyone but root even
then) or files (the runner's working folder is 0700 and its files 0600, by umask). What the agent works in (the
repository, its home, the harness's config and trajectory) is a folder owned by the agent user.

Two entry points, both started by the task runner (as root):
  `python -m harness.sandbox MODULE ARGS...`: MODULE, undumpable (the shim: the flag must be set after exec, which
      resets it);
  `python -I -m harness.sandbox --agent UID:GID --cwd DIR -- ARGV...`: ARGV as the agent (the harness). Where the
      interpreter, its virtualenv or the project live under a folder other users cannot traverse (a pyenv in /root,
      a checkout in a 0700 temporary folder, on the process launcher), the harness gets a mount namespace of its
      own in which that folder is an empty tmpfs holding only those, so that it runs without opening the rest.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import os
import pwd
import runpy
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from plumbing import relay, system_user

AGENT_USER = "evalplane-agent"
AGENT_UID = 10001  # fixed, so that files the agent leaves in a task image have one known owner
ISOLATE_ENV = "EVALPLANE_ISOLATE_AGENT"  # "0": the spec opted out (backend.isolate_agent = false, unsafe)
RUNNER_UMASK = 0o077  # every file of the runner and the shim: 0600, every folder 0700
AGENT_UMASK = 0o022
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


class SandboxError(RuntimeError):
    """The agent cannot be isolated here (not root, no agent user): refuse to run the task."""


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def undumpable() -> None:
    """This process's /proc entries (environ, mem, fd, maps) become root's: no other user can open them."""
    _prctl(PR_SET_DUMPABLE, 0)


def harden_runner() -> None:
    """The task runner's own settings: undumpable, private files, and every process the harness leaves behind
    re-parented to it (a subreaper), so that none outlives the harness (reap_agent)."""
    undumpable()
    os.umask(RUNNER_UMASK)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


@dataclass(frozen=True)
class Agent:
    """The user the harness runs as."""

    name: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict:
        """subprocess.Popen arguments that start a process as the agent (no supplementary groups)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": [], "umask": AGENT_UMASK}

    def argv(self, argv: list[str], cwd: Path, relay_port: int | None = None) -> list[str]:
        """argv wrapped so that it runs as the agent, in cwd (start it as root, from a folder of the runner's:
        `-I` keeps the agent's folder off the root interpreter's module path); with relay_port, in a network of its
        own where only that port of 127.0.0.1 (the shim's) leads anywhere."""
        relay = ["--relay", str(relay_port)] if relay_port else []
        return [sys.executable, "-I", "-m", "harness.sandbox", "--agent", f"{self.uid}:{self.gid}", "--cwd",
                str(cwd), *relay, "--", *argv]

    def own(self, path: Path) -> None:
        """path and everything under it owned by the agent (links themselves, never what they point to)."""
        system_user.give(path, self.uid, self.gid)


def agent_user(create: bool = False) -> Agent:
    """AGENT_USER from the user database; with create (in a task image), added with AGENT_UID if missing."""
    try:
        pw = pwd.getpwnam(AGENT_USER)
        return Agent(AGENT_USER, pw.pw_uid, pw.pw_gid)
    except KeyError:
        if not create:
            raise SandboxError(f"no user {AGENT_USER} on this host: run scripts/system-user.sh {AGENT_USER} as root") from None
    # The instance image may lack useradd (or differ in its flags): one line in each database does it.
    with open("/etc/group", "a") as f:
        f.write(f"{AGENT_USER}:x:{AGENT_UID}:\n")
    with open("/etc/passwd", "a") as f:
        f.write(f"{AGENT_USER}:x:{AGENT_UID}:{AGENT_UID}::/nonexistent:/bin/sh\n")
    return Agent(AGENT_USER, AGENT_UID, AGENT_UID)


def agent_for_task(in_task_image: bool) -> Agent | None:
    """The agent this task's harness runs as; None where the spec opted out. Raises SandboxError where the agent
    cannot be isolated (the task runner is not root)."""
    if os.environ.get(ISOLATE_ENV, "1") == "0":
        return None
    if os.geteuid() != 0:
        raise SandboxError(f"the task runner runs as uid {os.geteuid()}, not root: it cannot start the harness as "
                           f"another user (backend.isolate_agent = false runs it unisolated, which is unsafe)")
    return agent_user(create=in_task_image)


def agent_dir(agent: Agent | None) -> Path:
    """A fresh folder for the agent's files (repository, home, harness config, trajectory), owned by it, in the
    world-traversable temporary folder (the runner's own folders are closed to the agent)."""
    d = Path(tempfile.mkdtemp(prefix="evalplane-agent-"))
    if agent is not None:
        os.chown(d, agent.uid, agent.gid)
    return d


def read_agent_file(path: Path, limit: int = 64 << 20) -> bytes | None:
    """A file the agent wrote, read by the runner: never through a link (it could point at the runner's files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def reap_agent(keep: set[int], timeout_s: float = 10) -> int:
    """Kill every child of this process (the subreaper) but `keep`: what the harness left running, daemons
    included. Returns how many were killed."""
    killed, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in _children(os.getpid()) if p not in keep]
        if not left:
            break
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        for p in left:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
    return killed


def remove_agent_dir(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)  # rmtree never follows links


CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = (lambda v: v.encode() if v is not None else None)
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {source} on {target}: {os.strerror(e)}")


def closed_ancestor(path: str) -> str | None:
    """The topmost folder on path's way that other users cannot traverse, if any."""
    found, d = None, os.path.realpath(path)
    while True:
        if not os.stat(d).st_mode & stat.S_IXOTH:
            found = d
        if d == "/":
            return found
        d = os.path.dirname(d)


def _exposed_paths() -> list[str]:
    """What the harness needs to run: the interpreter's installation, its virtualenv and this project's source (the
    harness modules it imports), each reduced to the outermost (a venv inside the project is covered by it)."""
    paths = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, Path(__file__).resolve().parents[1])})
    return [p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)]


def expose_interpreter() -> None:
    """The interpreter's installation, its virtualenv and the project's source, reachable by any user in a mount
    namespace of this process's own: each closed folder above them is covered with an empty tmpfs and they are bound
    back in read-only (what the agent then sees of them is what it would see were the folders open)."""
    closed: dict[str, list[str]] = {}
    for path in _exposed_paths():
        if (top := closed_ancestor(path)) is not None:
            closed.setdefault(top, []).append(path)
    if not closed:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"the interpreter under {', '.join(closed)} is closed to the agent and no "
                                          f"mount namespace can open it (unshare: {os.strerror(ctypes.get_errno())})")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for top, paths in closed.items():
        staged = []
        for path in paths:  # held elsewhere while `top` is covered
            staging = tempfile.mkdtemp(prefix="evalplane-python-")
            _mount(path, staging, None, MS_BIND | MS_REC)
            staged.append((path, staging))
        _mount("tmpfs", top, "tmpfs", 0, "mode=0755,size=1m")
        for path, staging in staged:
            os.makedirs(path, exist_ok=True)
            _mount(staging, path, None, MS_BIND | MS_REC)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            if libc.umount2(staging.encode(), 2) != 0:  # MNT_DETACH
                raise OSError(ctypes.get_errno(), f"umount {staging}")
            os.rmdir(staging)


CLONE_NEWNET, SIOCSIFFLAGS, IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x40000000, 0x8914, 0x1, 0x8, 0x40
NOBODY = 65534


def isolate_network(port: int) -> None:
    """This process in a network namespace of its own: loopback only, where 127.0.0.1:port leads to the same port
    on the host's loopback (the shim) through a relay process, and nothing else leads anywhere."""
    libc = ctypes.CDLL(None, use_errno=True)
    host = os.open("/proc/self/ns/net", os.O_RDONLY)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"no network namespace for the agent: {os.strerror(ctypes.get_errno())}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    if os.fork() == 0:  # the relay: back in the host's namespace, as nobody, undumpable (the agent cannot use it)
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            if libc.setns(host, CLONE_NEWNET) != 0:
                os._exit(1)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            undumpable()  # it outlives the harness only until the runner reaps what the harness left (reap_agent)
            asyncio.run(relay.serve_listener(listener, "127.0.0.1", port))
        finally:
            os._exit(0)
    os.close(host)
    listener.close()


def enter(uid: int, gid: int, cwd: str, argv: list[str], relay_port: int | None = None) -> None:
    """Become the agent and exec argv (the privilege drop: no way back to root from here). relay_port: the agent's
    network is loopback only, with the shim's port relayed (the process launcher; a task container's network is
    the egress's to close)."""
    os.umask(AGENT_UMASK)  # the runner's 077 would close the folders made for the interpreter's mount
    expose_interpreter()
    if relay_port:
        isolate_network(relay_port)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("the privilege drop did not take")
    os.umask(AGENT_UMASK)
    os.chdir(cwd)
    os.execvpe(argv[0], argv, os.environ)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--agent"]:
        relay = None
        if argv[4:5] == ["--relay"]:
            relay = int(argv[5])
            argv = argv[:4] + argv[6:]
        if len(argv) < 6 or argv[2] != "--cwd" or argv[4] != "--":
            sys.exit("usage: python -I -m harness.sandbox --agent UID:GID --cwd DIR [--relay PORT] -- ARGV...")
        uid, gid = (int(x) for x in argv[1].split(":"))
        enter(uid, gid, argv[3], argv[5:], relay)
    if not argv:
        print("usage: python -m harness.sandbox MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    undumpable()
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
