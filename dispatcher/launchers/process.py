"""A local subprocess per task: `python -m harness <job-uri>` in its own session (process group).

The task runner runs as this process's user, which must be root unless the spec opted out (backend.isolate_agent =
false): it starts the harness as the agent user (harness/sandbox.py), a system user scripts/system-user.sh creates.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from contract import task_shape
from contract.models import AttemptRef
from dispatcher.launchers.base import (
    AttemptEnv,
    LaunchContext,
    Launcher,
    LaunchMeter,
    TaskHandle,
    no_attempt_env,
)
from harness import sandbox
from plumbing import system_user


def agent_isolation_problem(spec) -> str | None:
    """Why the spec's tasks cannot run here, naming the field; None when they can. The name the CLI knows: it asks
    the spec's launcher (dispatcher.launchers.problem), which for the process launcher is the isolation check."""
    from dispatcher import launchers

    return launchers.problem(spec)


def ensure_agent_user() -> sandbox.Agent:
    """The agent's system user, created with scripts/system-user.sh if missing (root only)."""
    try:
        system_user.ensure(sandbox.AGENT_USER)
    except system_user.SystemUserError as e:
        raise sandbox.SandboxError(str(e)) from None
    return sandbox.agent_user()


class ProcessLauncher(Launcher):
    backend = "local"
    task_images = False  # a checkout of the instance's bundle on this host

    @classmethod
    def create(cls, ctx: LaunchContext) -> ProcessLauncher:
        # Tasks: no database, no admin Valkey URL; the run's Valkey user, and (per attempt) its attempt key.
        env = local_task_env({**ctx.aws_env, task_shape.UPSTREAM_KEY_ENV: ctx.upstream_key, **ctx.valkey_user,
                              "EVALPLANE_STATE_DIR": str(ctx.state_dir)})
        return cls(ctx.run_dir / "tasks", env, ctx.attempt_env, isolate_agent=ctx.plan.spec.backend.isolate_agent)

    @classmethod
    def problem(cls, spec) -> str | None:
        """The agent runs isolated (backend.isolate_agent) only as another user, which needs root."""
        if not spec.backend.isolate_agent or os.geteuid() == 0:
            return None
        return (f"backend.isolate_agent: the process launcher runs the harness as the user {sandbox.AGENT_USER}, "
                f"apart from the task runner, which needs root (this runs as uid {os.geteuid()}); run as root, use "
                f"launcher = \"docker\", or set backend.isolate_agent = false (unsafe: the agent can then read the "
                f"run's provider key and credentials)")

    def __init__(self, log_dir: Path, env: dict[str, str], attempt_env: AttemptEnv = no_attempt_env,
                 isolate_agent: bool = True):
        """env: the task's environment (endpoints, the run's provider key, which only the shim gets, and the run's
        Valkey user); attempt_env(ref): what one attempt's task gets besides (its attempt key). isolate_agent: the
        harness runs as the agent user (needs root; see agent_isolation_problem)."""
        self.log_dir = log_dir
        if isolate_agent:
            if os.geteuid() != 0:
                raise sandbox.SandboxError("backend.isolate_agent: the process launcher needs root to isolate the agent")
            ensure_agent_user()
        self.env = env | {sandbox.ISOLATE_ENV: "1" if isolate_agent else "0"}
        self.attempt_env = attempt_env
        self._procs: dict[str, subprocess.Popen] = {}
        self.meter = LaunchMeter()

    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        """image is not used: the task runs on this host, on a checkout of its bundle."""
        log = self.log_dir / f"{ref.instance_id}.{ref.attempt}.task.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # the runner's log: not the agent's to read
        with self.meter.timed(), os.fdopen(fd, "ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "harness", job_uri],
                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env | self.attempt_env(ref), start_new_session=True,
            )
        self._procs[str(proc.pid)] = proc
        return TaskHandle(ref=ref, task_id=str(proc.pid))

    def poll(self, handle: TaskHandle) -> int | None:
        return self._procs[handle.task_id].poll()

    def stop(self, handle: TaskHandle) -> None:
        proc = self._procs.get(handle.task_id)
        if proc and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def find_running(self, run: str) -> list[TaskHandle]:
        """Child processes are not found again after a restart; their Valkey progress keys stand in."""
        return []

    def launch_report(self) -> str:
        return f"process launcher: {self.meter.report()}"


NOT_INHERITED = ("VALKEY_URL", "DATABASE_URL")  # the dispatcher's own (admin) stores: a task gets what `extra` says


def local_task_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment handed to local tasks: ours, minus anything secret-looking (by name, or a URL carrying a
    password) and the dispatcher's own store URLs, plus `extra`."""
    keep = {k: v for k, v in os.environ.items()
            if not any(s in k.upper() for s in ("KEY", "TOKEN", "SECRET", "PASSWORD"))
            and k not in NOT_INHERITED and not _url_with_password(v)}
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # fake credentials for moto locally
        if k in os.environ:
            keep[k] = os.environ[k]
    return keep | extra


def _url_with_password(value: str) -> bool:
    if "://" not in value or "@" not in value:
        return False
    try:
        return bool(urlsplit(value).password)
    except ValueError:
        return True  # unparseable, yet shaped like a URL with credentials: not handed on
