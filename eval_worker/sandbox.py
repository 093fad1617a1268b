"""Where an eval runs: the `GradingBackend` seam and its one implementation for now, `ProcessBackend`.

The grading code speaks in *container* terms, exactly as the official harness does: the repository is
at /testbed, the patch is copied to /tmp/patch.diff, the eval script to /eval.sh, the instance's conda
env `testbed` is under /opt/miniconda3, and commands run with /testbed as the working directory. A
backend maps that onto something real. `ProcessBackend` maps it onto a per-sandbox directory on this
machine (no Docker): the repository is cloned from the job's repo_source (a git bundle or repository
path) into <sandbox>/testbed, commands run as local processes with their own HOME, TMPDIR and
GIT_CONFIG_GLOBAL, and /opt/miniconda3 is the instance's (repo, version) environment built from its
recipe (eval_worker.environments), never the worker's own Python. The docker backend
(eval_worker.docker_backend) does not use this seam: it runs the official run_instance itself.

An instance without a recipe runs with the worker's Python on PATH only if its eval script installs
nothing; one that installs packages is refused (SandboxError, reason environment_unavailable).

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

from eval_worker.environments import (
    RECIPES_FILE,
    GradingEnvironmentError,
    ProcessEnvironment,
    RecipeBook,
    installs_packages,
    isolated_pip_env,
    process_environment,
    recipes_near,
)
from eval_worker.shell import map_container_paths, shell_lines

CONTAINER_WORKDIR = "/testbed"  # swebench.image_builder.constants.CONTAINER_WORKDIR
CONTAINER_CONDA_ROOT = "/opt/miniconda3"
KILL_GRACE_S = 2.0


class SandboxError(RuntimeError):
    """The sandbox could not be prepared or used: an infrastructure failure, never the model's.
    `reason` becomes the verdict's infra_failure_reason."""

    def __init__(self, message: str, reason: str = "sandbox_unavailable"):
        super().__init__(message)
        self.reason = reason


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

    def create(self, *, instance: dict, repo_source: str) -> Sandbox:
        """A fresh sandbox for the instance row: its repository checked out at base_commit in /testbed,
        in the instance's environment.

        Raises SandboxError when that cannot be done (clone failure, missing commit, no environment...).
        """


# ------------------------------------------------------------------------------ process backend


class ProcessSandbox:
    def __init__(self, root: Path, environment: ProcessEnvironment | None = None, lock=None, keep: bool = False):
        self.root = root
        self.keep = keep  # close() keeps the directory (debugging)
        self.testbed = root / "testbed"
        self.home = root / "home"
        self.tmp = root / "tmp"
        self.gitconfig = root / "gitconfig"
        self.environment = environment
        self._lock = lock  # the environment's, held until close()
        for d in (self.home, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.gitconfig.touch()
        self.mapping = {
            CONTAINER_WORKDIR: str(self.testbed),
            "/tmp/patch.diff": str(self.tmp / "patch.diff"),
            "/eval.sh": str(root / "eval.sh"),
        }
        if environment is not None:
            # as in an instance image: conda's bin on PATH, `conda activate testbed` for the rest; pip only
            # from the environment's wheelhouse, whatever this machine's pip configuration says
            self.mapping[CONTAINER_CONDA_ROOT] = str(environment.conda_root)
            path = os.pathsep.join([str(environment.conda_root / "bin"), system_path()])
            pip = {k: v for k, v in isolated_pip_env(environment.wheels).items() if k.startswith("PIP_")}
        else:
            path = str(Path(sys.executable).parent) + os.pathsep + system_path()
            pip = {}
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
            self.release()
            if not self.keep:
                shutil.rmtree(self.root, ignore_errors=True)

    def release(self) -> None:
        """Let other gradings use the environment (idempotent)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


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


class ProcessBackend:
    """Sandboxes as local directories and processes (machines without Docker).

    recipes: environment recipes by (repo, version), in addition to the `environments.toml` beside each
    job's repository bundle; env_root: where the environments are built (default <state dir>/grading-envs);
    pythons: the interpreters recipes may use (default: those on PATH, never the worker's own).
    """

    name = "process"

    def __init__(self, root: str | Path | None = None, keep: bool = False, clone_timeout: float = 300.0,
                 recipes: RecipeBook | None = None, env_root: str | Path | None = None,
                 pythons: list[str] | None = None):
        self.root = Path(root) if root else None
        self.keep = keep
        self.clone_timeout = clone_timeout
        self.recipes = recipes or RecipeBook()
        self.env_root = Path(env_root) if env_root else None
        self.pythons = pythons
        self._environments: dict[str, ProcessEnvironment] = {}

    def environment(self, instance: dict, repo_source: str) -> ProcessEnvironment | None:
        """The instance's (repo, version) environment (not yet built or locked), or None without a recipe.
        Raises SandboxError (environment_unavailable) when there is none and the eval script installs
        packages, or when the recipe cannot be used here."""
        repo, version = instance["repo"], str(instance["version"])
        try:
            book = self.recipes.merged(recipes_near(repo_source)) if "://" not in repo_source else self.recipes
            recipe = book.get(repo, version)
            if recipe is None:
                installs = installs_packages(instance["eval_script"])
                if installs:
                    where = ", ".join(book.sources) or f"no {RECIPES_FILE} beside {repo_source}"
                    raise SandboxError(
                        f"{instance['instance_id']}: no environment recipe for {repo} {version} ({where}), and its "
                        f"eval script installs packages ({installs[0]!r}): refusing to run it in the worker's "
                        f"own environment", reason="environment_unavailable")
                return None
            key = recipe.digest()  # one environment per recipe, whichever of its versions
            if key not in self._environments:
                self._environments[key] = process_environment(recipe, root=self.env_root, pythons=self.pythons)
            return self._environments[key]
        except GradingEnvironmentError as e:
            raise SandboxError(f"{instance['instance_id']}: {e}", reason="environment_unavailable") from e

    def create(self, *, instance: dict, repo_source: str) -> ProcessSandbox:
        iid, base_commit = instance["instance_id"], instance["base_commit"]
        src = repo_source
        if "://" not in src:
            if not Path(src).exists():
                raise SandboxError(f"repo_source does not exist: {src}")
            src = str(Path(src).resolve())
        environment = self.environment(instance, repo_source)
        if self.root:
            self.root.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", iid)
        root = Path(tempfile.mkdtemp(prefix=f"ep-sandbox-{safe}-", dir=self.root))
        try:
            lock = environment.acquire() if environment is not None else None
        except GradingEnvironmentError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise SandboxError(f"{iid}: {e}", reason="environment_unavailable") from e
        sb = ProcessSandbox(root, environment, lock, keep=self.keep)
        try:
            for args in (
                ["git", "clone", "-q", "--no-hardlinks", src, str(sb.testbed)],
                ["git", "-c", "advice.detachedHead=false", "checkout", "-q", base_commit],
            ):
                r = subprocess.run(
                    args, cwd=str(sb.testbed if args[1] != "clone" else root), env=sb.env,
                    stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=self.clone_timeout, check=False,
                )
                if r.returncode != 0:
                    raise SandboxError(f"{' '.join(args[:3])} failed ({r.returncode}): {r.stderr.strip()}")
            if environment is not None and not installs_packages(instance["eval_script"]):
                # what an instance image's build did: the repository installed into testbed (an eval script
                # that reinstalls it would only repeat this)
                r = sb.exec(f"source {CONTAINER_CONDA_ROOT}/bin/activate && conda activate testbed && "
                            f"{environment.recipe.install}", timeout=self.clone_timeout)
                if r.exit_code != 0:
                    raise SandboxError(f"{environment.recipe.install!r} failed in {environment.path} "
                                       f"({r.exit_code}): {r.output.strip()[-2000:]}", reason="environment_unavailable")
        except SandboxError:
            sb.close()
            raise
        except (OSError, subprocess.SubprocessError) as e:
            sb.close()
            raise SandboxError(f"could not prepare sandbox: {e}") from e
        return sb


__all__ = [
    "CONTAINER_CONDA_ROOT",
    "CONTAINER_WORKDIR",
    "ExecResult",
    "GradingBackend",
    "ProcessBackend",
    "ProcessSandbox",
    "Sandbox",
    "SandboxError",
    "map_container_paths",
    "shell_lines",
    "system_path",
]
