"""Where the process grader (eval_worker.process_grader) runs an eval: a `Sandbox`, and its confined
implementation `ProcessSandbox`.

The grading code speaks in *container* terms, exactly as the official harness does: the repository is
at /testbed, the patch is copied to /tmp/patch.diff, the eval script to /eval.sh, the instance's conda
env `testbed` is under /opt/miniconda3, and commands run with /testbed as the working directory. A
`ProcessSandbox` maps that onto a per-sandbox directory on this machine (no Docker): the repository cloned from
the job's repo_source into <sandbox>/testbed, commands run as local processes with their own HOME, TMPDIR and
GIT_CONFIG_GLOBAL, and /opt/miniconda3 is the grading's copy of the instance's environment
(eval_worker.environments). The docker grader (eval_worker.docker_backend) does not use it: it runs the official
run_instance itself.

Every command runs confined, since the eval script runs the model's code (the tests import the patched package):
bubblewrap (Debian's `bubblewrap`) gives it mount, PID, network, IPC and UTS namespaces of its own, and setpriv drops
it to `evalplane-grader` (not the agent's user, not the worker's) with no capabilities and no_new_privs. It sees
the system's programs and /etc read-only, its sandbox folder and its environment copy (the only places it can
write, with a private /tmp), the interpreter its environment was made from read-only, and nothing of the state
folder, the project or any other process; its network is loopback only. The worker (root, which bubblewrap needs
to mount what the grader itself could not open) never holds the verdict key where the grading can reach it.

Limitation of the process backend: container paths are rewritten in command text (outside heredoc
bodies, so patches carried by the eval script are never touched); the environment is rebuilt from a recipe, not
the instance image's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from eval_worker.environments import ProcessEnvironment, isolated_pip_env
from eval_worker.graders import GradingSandboxError
from eval_worker.shell import map_container_paths, shell_lines

CONTAINER_WORKDIR = "/testbed"  # swebench.image_builder.constants.CONTAINER_WORKDIR
CONTAINER_CONDA_ROOT = "/opt/miniconda3"
KILL_GRACE_S = 2.0


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    output: str  # stdout and stderr merged, in order
    timed_out: bool = False
    runtime_s: float = 0.0
    pgid: int | None = None


@runtime_checkable
class Sandbox(Protocol):
    def put_file(self, container_path: str, content: str) -> None:
        """Write a text file at a container path (e.g. /tmp/patch.diff, /eval.sh)."""

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run a bash command line in /testbed; on timeout the whole process tree is killed."""

    def close(self) -> None:
        """Tear everything down (idempotent)."""


# ------------------------------------------------------------------------------ confinement


GRADER_USER = "evalplane-grader"
SYSTEM_RO = ("/usr", "/etc")  # programs, libraries and configuration, read-only as they are
MERGED_USR = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # links into /usr on merged-/usr systems


def confinement_problem() -> str | None:
    """Why commands cannot be confined here; None when they can."""
    if os.geteuid() != 0:
        return (f"the process grading backend runs the eval script as {GRADER_USER} in namespaces of its own, which "
                f"needs root (this runs as uid {os.geteuid()}); use eval.backend = \"docker\"")
    for tool, package in (("bwrap", "bubblewrap"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            return f"the process grading backend needs {tool} (Debian's {package}; scripts/bootstrap.sh installs it)"
    return None


@dataclass(frozen=True)
class Confinement:
    """What a confined command sees (see the module's docstring): `writable` folders (destination -> source) and
    `readable` ones, each at its own path; everything else of this machine but the system's programs is absent."""

    uid: int
    gid: int
    writable: dict[str, str]
    readable: tuple[str, ...] = ()

    def argv(self, command: list[str], cwd: Path) -> list[str]:
        mounts: list[str] = []
        for d in SYSTEM_RO:
            mounts += ["--ro-bind", d, d]
        for d in MERGED_USR:
            if os.path.islink(d):
                mounts += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                mounts += ["--ro-bind", d, d]
        mounts += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        binds = [(dest, src, "--bind") for dest, src in self.writable.items()]
        binds += [(p, p, "--ro-bind") for p in self.readable if not _under(p, SYSTEM_RO + MERGED_USR)]
        binds.sort(key=lambda b: b[0].count("/"))
        made = {"/", "/tmp", *SYSTEM_RO, *MERGED_USR}
        for dest, src, how in binds:
            # the folders above a mount point: open to the grader, whatever they are on the host (a 0700 checkout)
            for parent in reversed(Path(dest).parents):
                if str(parent) not in made and not _under(str(parent), [b[0] for b in binds if b[0] != dest]):
                    mounts += ["--perms", "0755", "--dir", str(parent)]
                    made.add(str(parent))
            mounts += [how, src, dest]
        drop = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return [shutil.which("bwrap") or "/usr/bin/bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session", *mounts,
                "--chdir", str(cwd), "--", *drop, *command]


def _under(path: str, tops) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


class ProcessSandbox:
    """A sandbox folder (root's) holding the checkout, the grader's home and temporary folder, its copy of the
    environment, and the files the grading puts in (the patch, the eval script: root's, read-only to the grader)."""

    def __init__(self, root: Path, grader: tuple[int, int], environment: ProcessEnvironment | None = None,
                 keep: bool = False):
        self.root = root
        self.keep = keep  # close() keeps the directory (debugging)
        self.testbed = root / "testbed"
        self.home = root / "home"
        self.tmp = root / "tmp"
        self.gitconfig = self.home / ".gitconfig"  # git writes a lock file beside it: in a folder of the grader's
        self.environment = environment
        self.grader = grader
        os.chmod(root, 0o755)
        for d in (self.home, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, *grader)
        self.gitconfig.touch()
        os.chown(self.gitconfig, *grader)
        self.mapping = {
            CONTAINER_WORKDIR: str(self.testbed),
            "/tmp/patch.diff": str(root / "patch.diff"),
            "/eval.sh": str(root / "eval.sh"),
        }
        writable = {str(root): str(root)}  # what in it is root's (this folder, the patch, the script) stays read-only
        if environment is not None:
            # as in an instance image: conda's bin on PATH, `conda activate testbed` for the rest; pip only
            # from the environment's wheelhouse, whatever this machine's pip configuration says
            self.mapping[CONTAINER_CONDA_ROOT] = str(environment.conda_root)
            path = os.pathsep.join([str(environment.conda_root / "bin"), system_path()])
            pip = {k: v for k, v in isolated_pip_env(environment.wheels).items() if k.startswith("PIP_")}
            writable[str(environment.path)] = str(root / "environment")  # the grading's copy, where it was built
            readable = [str(Path(environment.python).resolve().parents[1]), str(environment.wheels)]
        else:
            path = str(Path(sys.executable).parent) + os.pathsep + system_path()
            pip = {}
            readable = [sys.prefix, sys.base_prefix]
        self.confinement = Confinement(*grader, writable=writable, readable=tuple(
            readable + [d for d in system_path().split(os.pathsep) if os.path.isdir(d)]))
        self.env = {
            "PATH": path,
            "HOME": str(self.home),
            "TMPDIR": str(self.tmp),
            "GIT_CONFIG_GLOBAL": str(self.gitconfig),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **pip,
        }
        self._closed = False

    def host_path(self, container_path: str) -> Path:
        mapped = map_container_paths(container_path, self.mapping)
        if mapped == container_path:
            raise GradingSandboxError(f"no host mapping for container path {container_path!r}")
        return Path(mapped)

    def put_file(self, container_path: str, content: str) -> None:
        p = self.host_path(container_path)
        if p.parent != self.root:  # only into the sandbox's own folder, which the grader cannot change
            raise GradingSandboxError(f"put_file: {container_path!r} maps into a folder the grading writes")
        if container_path.endswith(".sh"):  # a script: its container paths must point into the sandbox
            content = map_container_paths(content, self.mapping)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(p, 0o644)

    def exec(self, cmd: str, timeout: float | None = None, cwd: Path | None = None) -> ExecResult:
        cmd = map_container_paths(cmd, self.mapping)
        start = time.monotonic()
        timed_out = False
        try:
            # the output never passes through a file the grading could swap for a link
            with tempfile.TemporaryFile() as out:
                proc = subprocess.Popen(
                    self.confinement.argv(["/bin/bash", "-c", cmd], cwd or self.testbed),
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,  # merged, in order, like docker exec
                    start_new_session=True,  # own session and process group
                )
                pgid = proc.pid
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(pgid, proc)
                else:
                    # the command is done; nothing it started may outlive it
                    _kill_group(pgid, None, grace=0)
                out.seek(0)
                output = out.read().decode(errors="replace")
        except OSError as e:
            raise GradingSandboxError(f"exec failed: {e}") from e
        return ExecResult(
            exit_code=None if timed_out else proc.returncode,
            output=output,
            timed_out=timed_out,
            runtime_s=time.monotonic() - start,
            pgid=pgid,
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.keep:
                shutil.rmtree(self.root, ignore_errors=True)


CONTAINER_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def system_path() -> str:
    """PATH as in an instance image (the system's directories; never the worker's virtualenv, nor user-level
    tool managers such as pyenv shims, whose python or pytest would stand in for a missing one), plus the
    directory of this machine's git if it lives elsewhere."""
    dirs = list(CONTAINER_PATH)
    git = shutil.which("git")
    if git and str(Path(git).parent) not in dirs:
        dirs.append(str(Path(git).parent))
    return os.pathsep.join(dirs)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pgid: int, proc: subprocess.Popen | None, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the whole process group (as the official harness TERMs the exec), then SIGKILL."""
    try:
        os.killpg(pgid, signal.SIGTERM if grace else signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while grace and time.monotonic() < deadline:
        if proc is not None and proc.poll() is None:
            time.sleep(0.05)
            continue
        if not _group_alive(pgid):
            break
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait()


__all__ = [
    "CONTAINER_CONDA_ROOT",
    "CONTAINER_WORKDIR",
    "GRADER_USER",
    "Confinement",
    "ExecResult",
    "ProcessSandbox",
    "Sandbox",
    "confinement_problem",
    "map_container_paths",
    "shell_lines",
    "system_path",
]
