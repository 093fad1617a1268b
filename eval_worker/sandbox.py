"""Where an eval runs: the `GradingBackend` seam and its one implementation for now, `ProcessBackend`.

The grading code speaks in *container* terms, exactly as the official harness does: the repository is
at /testbed, the patch is copied to /tmp/patch.diff, the eval script to /eval.sh, and commands run with
/testbed as the working directory. A backend maps that onto something real. `ProcessBackend` maps it
onto a per-sandbox directory on this machine (no Docker): the repository is cloned from the job's
repo_source (a git bundle or repository path) into <sandbox>/testbed, commands run as local
processes with their own HOME, TMPDIR and GIT_CONFIG_GLOBAL, and the python/pytest on PATH are the
worker's own (its virtualenv's). The docker backend (eval_worker.docker_backend) does not use this
seam: it runs the official run_instance itself, in the instance image.

Limitation of the process backend: container paths are rewritten in command text (outside heredoc
bodies, so patches carried by the eval script are never touched); isolation is only a directory.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

CONTAINER_WORKDIR = "/testbed"  # swebench.image_builder.constants.CONTAINER_WORKDIR
KILL_GRACE_S = 2.0


class SandboxError(RuntimeError):
    """The sandbox could not be prepared or used: an infrastructure failure, never the model's."""


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


@runtime_checkable
class GradingBackend(Protocol):
    name: str

    def create(self, *, instance_id: str, repo_source: str, base_commit: str) -> Sandbox:
        """A fresh sandbox with the repository checked out at base_commit in /testbed.

        Raises SandboxError when that cannot be done (clone failure, missing commit, disk...).
        """


# ------------------------------------------------------------------------------- path mapping

_HEREDOC = re.compile(r"(?<!<)<<(?!<)-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def map_container_paths(script: str, mapping: dict[str, str]) -> str:
    """Rewrite container paths (keys of mapping) to host paths in shell text, except inside heredoc
    bodies. A path only matches as a whole path component sequence (not as part of a longer name)."""
    if not mapping:
        return script
    keys = sorted(mapping, key=len, reverse=True)
    pattern = re.compile(
        r"(?<![\w./-])(" + "|".join(re.escape(k) for k in keys) + r")(?![\w.-])"
    )
    out: list[str] = []
    delims: list[str] = []
    for line in script.split("\n"):
        if delims:
            out.append(line)
            if line.strip() == delims[0]:
                delims.pop(0)
            continue
        out.append(pattern.sub(lambda m: mapping[m.group(1)], line))
        delims.extend(m.group(2) for m in _HEREDOC.finditer(line))
    return "\n".join(out)


# ------------------------------------------------------------------------------ process backend


class ProcessSandbox:
    def __init__(self, root: Path, extra_env: dict[str, str] | None = None):
        self.root = root
        self.testbed = root / "testbed"
        self.home = root / "home"
        self.tmp = root / "tmp"
        self.gitconfig = root / "gitconfig"
        for d in (self.home, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.gitconfig.touch()
        self.mapping = {
            CONTAINER_WORKDIR: str(self.testbed),
            "/tmp/patch.diff": str(self.tmp / "patch.diff"),
            "/eval.sh": str(root / "eval.sh"),
        }
        venv_bin = str(Path(sys.executable).parent)
        self.env = {
            "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.home),
            "TMPDIR": str(self.tmp),
            "GIT_CONFIG_GLOBAL": str(self.gitconfig),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **(extra_env or {}),
        }
        self._closed = False

    def host_path(self, container_path: str) -> Path:
        mapped = map_container_paths(container_path, self.mapping)
        if mapped == container_path:
            raise SandboxError(f"no host mapping for container path {container_path!r}")
        return Path(mapped)

    def put_file(self, container_path: str, content: str) -> None:
        p = self.host_path(container_path)
        if container_path.endswith(".sh"):  # a script: its container paths must point into the sandbox
            content = map_container_paths(content, self.mapping)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)

    def exec(self, cmd: str, timeout: float | None = None, cwd: Path | None = None) -> ExecResult:
        cmd = map_container_paths(cmd, self.mapping)
        out_path = Path(tempfile.mkstemp(prefix="exec-", suffix=".out", dir=self.root)[1])
        start = time.monotonic()
        timed_out = False
        try:
            with open(out_path, "wb") as out:
                proc = subprocess.Popen(
                    ["/bin/bash", "-c", cmd],
                    cwd=str(cwd or self.testbed),
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
            output = out_path.read_bytes().decode(errors="replace")
        except OSError as e:
            raise SandboxError(f"exec failed: {e}") from e
        finally:
            out_path.unlink(missing_ok=True)
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
            shutil.rmtree(self.root, ignore_errors=True)


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


class ProcessBackend:
    """Sandboxes as local directories and processes (machines without Docker)."""

    name = "process"

    def __init__(self, root: str | Path | None = None, keep: bool = False, clone_timeout: float = 300.0):
        self.root = Path(root) if root else None
        self.keep = keep
        self.clone_timeout = clone_timeout

    def create(self, *, instance_id: str, repo_source: str, base_commit: str) -> ProcessSandbox:
        if self.root:
            self.root.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", instance_id)
        root = Path(tempfile.mkdtemp(prefix=f"ep-sandbox-{safe}-", dir=self.root))
        sb = ProcessSandbox(root)
        if self.keep:
            sb.close = lambda: None  # type: ignore[method-assign]
        try:
            src = repo_source
            if "://" not in src and not Path(src).exists():
                raise SandboxError(f"repo_source does not exist: {src}")
            for args in (
                ["git", "clone", "-q", "--no-hardlinks", src, str(sb.testbed)],
                ["git", "-c", "advice.detachedHead=false", "checkout", "-q", base_commit],
            ):
                r = subprocess.run(
                    args, cwd=str(sb.testbed if args[1] != "clone" else root), env=sb.env,
                    stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=self.clone_timeout,
                )
                if r.returncode != 0:
                    raise SandboxError(f"{' '.join(args[:3])} failed ({r.returncode}): {r.stderr.strip()}")
        except SandboxError:
            sb.close()
            raise
        except (OSError, subprocess.SubprocessError) as e:
            sb.close()
            raise SandboxError(f"could not prepare sandbox: {e}") from e
        return sb


__all__ = [
    "CONTAINER_WORKDIR",
    "ExecResult",
    "GradingBackend",
    "ProcessBackend",
    "ProcessSandbox",
    "Sandbox",
    "SandboxError",
    "map_container_paths",
]
