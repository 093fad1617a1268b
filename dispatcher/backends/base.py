"""The Backend seam: where a run's tasks, queues, keys and graders live.

A backend owns, for one spec: the run's resources (its bucket and queues), its keys (the verdict key's file) and its
Valkey (the dispatcher's URL, the tasks' run user), the upstream its tasks call (a gateway, or the simulator it
starts), its launcher (built from a LaunchContext by the launcher class `backend.launcher` names), its eval workers
(started, watched, stopped), and its image policy (whether tasks run in task images, where those go, whether they
are built here). The driver loop (dispatcher/driver/loop.py) talks only to a Backend and its Launcher.

Backends are registered by name in dispatcher.backends.BACKENDS ("local", "aws"); `backend.kind` names one, or
gives a dotted path "package.module:Class" to a Backend subclass kept elsewhere. `dispatcher.backends.for_spec(spec)`
is how everyone gets the spec's backend.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from contract import signing
from contract.signing import RunKeys
from dispatcher.backends import daemons

if TYPE_CHECKING:
    import redis

    from dispatcher.backends.resources import RunResources
    from dispatcher.images import Target
    from dispatcher.launchers.base import LaunchContext, Launcher
    from dispatcher.plan import Plan
    from gateway.runs import RunGateway


def attempt_env(run_keys: RunKeys):
    """What each task gets besides the run's environment: its attempt's key, to sign its messages with."""
    return lambda ref: {signing.ATTEMPT_KEY_ENV: run_keys.attempt_key(ref).decode()}


def key_folder() -> Path:
    """The dispatcher's 0700 folder of key files (the verdict key; never a task's to read)."""
    folder = daemons.state_dir() / "keys"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


class Backend:
    """One spec's backend. Making one does nothing; the methods below do what they say, when asked."""

    launchers: ClassVar[tuple[str, ...]] = ()  # the registered launchers it runs tasks with (for messages)
    builds_images: ClassVar[bool] = True  # task images are built on this host (else by a build tier, looked up)
    # its Valkey, S3/SQS and simulator are this machine's local stack (scripts/stack.sh), not an estate's
    local_stack: ClassVar[bool] = True
    spot_capacity: ClassVar[bool] = False  # harness tasks can run on interruptible capacity (backend.spot)

    def __init__(self, spec):
        self.spec = spec
        self.launcher: Launcher | None = None  # once make_launcher has built it

    # ------------------------------------------------------------------ what validation asks
    @classmethod
    def default_launcher(cls, adapter) -> str:
        """backend.launcher when the spec leaves it unset, for a harness (adapter: its HarnessAdapter class)."""
        return cls.launchers[0]

    @classmethod
    def spec_problem(cls, backend_spec) -> str | None:
        """What [backend] lacks for this backend (None when it has everything)."""
        if backend_spec.spot and not cls.spot_capacity:
            return "spot: this backend has no Spot capacity (the aws backend's Fargate Spot has)"
        return None

    @classmethod
    def runs(cls, launcher: type[Launcher]) -> bool:
        """Whether this backend can run tasks with `launcher` (a launcher names the backend it runs under)."""
        from dispatcher.backends import BACKENDS

        return issubclass(cls, BACKENDS.get(launcher.backend))

    # ------------------------------------------------------------------ image policy
    @property
    def in_task_images(self) -> bool:
        """Attempts run in task images (dispatcher.images), rather than on a checkout of their bundle here."""
        from dispatcher.launchers import launcher_class

        return launcher_class(self.spec).task_images

    def image_target(self) -> Target:
        """Where the spec's task images are pushed and run from."""
        from dispatcher.images import Target

        images = self.spec.images
        return Target(images.registry or "", images.repository, images.instance_registry)

    def image_problems(self, plan: Plan) -> dict[str, str]:
        """What each instance lacks to run in its task image, without building anything ({} where tasks do not run
        in task images)."""
        return {}

    # ------------------------------------------------------------------ what the CLI asks
    def aws_env(self) -> dict[str, str]:
        """The AWS endpoints and region the dispatcher (and its Ray workers) use."""
        return daemons.aws_env()

    def bucket(self) -> str:
        """The S3 bucket of the run's job documents and artifacts, its store answering."""
        raise NotImplementedError

    @property
    def queue_prefix(self) -> str:
        """What the run's queue names start with."""
        return ""

    @functools.cached_property
    def run_dir(self) -> Path:
        """The run's folder on the dispatcher's host (its key, task logs, local services' pids)."""
        path = daemons.state_dir() / "runs" / self.spec.run.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    # ------------------------------------------------------------------ a run
    def run_resources(self) -> RunResources:
        """The run's bucket prefix and queues, made if missing (idempotent)."""
        from dispatcher.backends import resources

        return resources.ensure(self.spec.run.name, bucket=self.bucket(), queue_prefix=self.queue_prefix)

    def verdict_key_file(self) -> Path:
        """The verdict key's 0600 file, which the results writers read (made on first use here)."""
        return key_folder() / "verdict.key"

    def key_files(self) -> tuple[str, str]:
        """The run secret (attempt keys derive from it) and the verdict key: 0600 files the writers read."""
        return str(self.run_dir / "run.key"), str(self.verdict_key_file())

    def valkey_url(self, given: str) -> str:
        """The dispatcher's (admin) Valkey URL for the run, from the one the CLI found."""
        return given

    def upstream(self, plan: Plan) -> tuple[str, str]:
        """(URL, key) of the provider endpoint the run's tasks call, as the dispatcher reaches it."""
        raise NotImplementedError

    def open_gateway(self, plan: Plan, conn, valkey_url: str, run_keys: RunKeys, upstream: str,
                     provider_key: str) -> RunGateway:
        """With [gateway]: the gateway tier running, the provider key with it alone, the pool's alias registered
        with the upstream as its deployment, the run's key minted (gateway/runs.py)."""
        raise NotImplementedError(f"backend {self.spec.backend.kind} has no gateway tier yet")

    def close_gateway(self, conn, valkey: redis.Redis) -> None:
        """The run has ended (finished, cancelled, failed): its gateway key is refused from now on (its provider
        key, where it has one, revoked after its usage is recorded). Idempotent."""
        from gateway import runs

        runs.close_run(conn, valkey, self.spec.run.name)

    def task_valkey_user(self, admin: redis.Redis, valkey_url: str, run_keys: RunKeys) -> dict[str, str]:
        """The environment that gives tasks the run's own Valkey user ({} where they get it elsewhere)."""
        return {}

    def make_launcher(self, ctx: LaunchContext) -> Launcher:
        """The run's launcher: the class backend.launcher names, built from the context."""
        from dispatcher.launchers import launcher_class

        self.launcher = launcher_class(self.spec).create(ctx)
        return self.launcher

    def start_eval_workers(self, res: RunResources, run_keys: RunKeys) -> None:
        """spec.eval.workers graders consuming the run's eval queue."""
        raise NotImplementedError

    def check_eval_workers(self) -> None:
        """Raise if an eval worker this backend follows has died (the run would wait on grading forever)."""

    def stop_eval_workers(self) -> None:
        """Stop the eval workers this process started that still run (the run ended, or the driver failed)."""

    def finish(self, admin: redis.Redis) -> None:
        """The run ended: what the backend made for it alone goes (its services, its Valkey user)."""
