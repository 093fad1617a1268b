"""One container per attempt on a local Docker engine, on an internal network whose only way out is the egress.

Each container runs its attempt's task image (the instance's own image plus the task runtime, dispatcher.images),
by digest, with the job reference as its only argument. Its environment carries endpoints (rewritten to
the egress) and the provider key, which the task hands to its shim alone. Containers are labelled with
run, instance and attempt, so a resumed dispatcher finds the ones still running (`find_running`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import docker
import docker.errors

from contract import task_shape
from contract.models import OOM_KILLED, AttemptRef, TaskResources
from dispatcher.launchers.base import (
    AttemptEnv,
    LaunchContext,
    Launcher,
    LaunchMeter,
    TaskHandle,
    no_attempt_env,
)
from harness.sandbox import ISOLATE_ENV
from plumbing.egress import EGRESS_IMAGE, Egress

L_ROLE, L_RUN, L_INSTANCE, L_ATTEMPT = "evalplane.role", "evalplane.run", "evalplane.instance", "evalplane.attempt"


TASK_NETWORK_ENV = "EVALPLANE_TASK_NETWORK"


def task_network() -> str:
    """The tasks' network (its egress container is `<network>-egress`): EVALPLANE_TASK_NETWORK names another than
    the default, for runs sharing one engine at once with other upstreams (an egress serves one set of routes)."""
    return os.environ.get(TASK_NETWORK_ENV, "evalplane-tasks")


def container_name(ref: AttemptRef) -> str:
    """One name per attempt: Docker itself then refuses a second container for the same attempt."""
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", f"ep-{ref.run}-{ref.instance_id}-{ref.attempt}")


class DockerLauncher(Launcher):
    backend = "local"
    task_images = True

    @classmethod
    def create(cls, ctx: LaunchContext) -> DockerLauncher:
        """Tasks reach the upstream, Valkey and the S3/SQS endpoints, through the egress, and nothing else."""
        endpoints = sorted({v for k, v in ctx.aws_env.items() if k.startswith("AWS_ENDPOINT_URL")})
        env = ctx.aws_env | ctx.valkey_user | {
            task_shape.UPSTREAM_KEY_ENV: ctx.upstream_key, "EVALPLANE_STATE_DIR": task_shape.STATE_DIR,
            ISOLATE_ENV: "1" if ctx.plan.spec.backend.isolate_agent else "0",
            task_shape.OWN_CGROUP_ENV: "1"}
        return cls(env, [ctx.upstream_url, ctx.valkey_url, *endpoints], log_dir=ctx.run_dir / "tasks",
                   attempt_env=ctx.attempt_env, network=task_network(), resources=ctx.plan.spec.backend.resources)

    def __init__(self, env: dict[str, str], allowed: Sequence[str], *, egress_image: str = EGRESS_IMAGE,
                 network: str = "evalplane-tasks", log_dir: Path | None = None,
                 resources: TaskResources | None = None,
                 client: docker.DockerClient | None = None, attempt_env: AttemptEnv = no_attempt_env):
        """allowed: the endpoints tasks may reach (URLs or host:port): the upstream gateway, the S3/SQS
        endpoint, Valkey. env values that name an allowed endpoint are rewritten to its egress address.
        attempt_env(ref): what one attempt's container gets besides env (its attempt key). resources: each
        container's CPUs, guaranteed memory (mem_reservation) and kill threshold (mem_limit); default the spec's."""
        self.attempt_env = attempt_env
        self.client = client or docker.from_env()
        self.log_dir = log_dir
        if resources is None:  # the spec's defaults
            from dispatcher.spec import BackendSpec

            resources = BackendSpec().resources
        self.resources = resources
        self.egress = Egress(self.client, network, list(allowed), egress_image).up()
        self.env = {k: self._rewrite(v) for k, v in env.items()}
        self._exited: dict[str, int] = {}
        self._oom: set[str] = set()  # containers the engine saw killed for memory (State.OOMKilled)
        self.meter = LaunchMeter()

    def task_url(self, url: str) -> str:
        """The URL a task must use for an allowed endpoint (write this into job documents)."""
        return self.egress.url(url)

    def launch_report(self) -> str:
        return f"docker launcher: {self.meter.report()}"

    def _rewrite(self, value: str) -> str:
        return self.egress.url(value) if self.egress.allows(value) else value

    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        if not image:
            raise ValueError(f"{ref.slug}: the docker launcher runs task images; none was given (dispatcher.images)")
        name = container_name(ref)
        try:
            old = self.client.containers.get(name)
            if old.status in ("created", "running", "restarting"):
                return TaskHandle(ref=ref, task_id=old.id)  # never two tasks for one attempt
            old.remove(force=True)
        except docker.errors.NotFound:
            pass
        with self.meter.timed():
            c = self.client.containers.run(
                image, [job_uri], name=name, detach=True, network=self.egress.name, environment=self.env | self.attempt_env(ref),
                labels={L_ROLE: "task", L_RUN: ref.run, L_INSTANCE: ref.instance_id, L_ATTEMPT: str(ref.attempt)},
                nano_cpus=int(self.resources.cpu * 1e9), mem_limit=f"{self.resources.memory_limit_mib}m",
                mem_reservation=f"{self.resources.memory_mib}m",
                memswap_limit=f"{self.resources.memory_limit_mib}m",  # no swap past the limit: it is the limit
                init=True,
                user="0:0",  # the task runner: root, so that it can run the harness as the agent (harness/sandbox.py)
            )
        return TaskHandle(ref=ref, task_id=c.id)

    def poll(self, handle: TaskHandle) -> int | None:
        """None while running; the exit code once exited (the container is then logged and removed)."""
        if handle.task_id in self._exited:
            return self._exited[handle.task_id]
        try:
            c = self.client.containers.get(handle.task_id)
        except docker.errors.NotFound:
            self._exited[handle.task_id] = -1  # gone under us (removed by hand or by an earlier dispatcher)
            return -1
        if c.status not in ("exited", "dead"):
            return None
        code = int(c.attrs["State"]["ExitCode"])
        if c.attrs["State"].get("OOMKilled"):
            self._oom.add(handle.task_id)
        if self.log_dir is not None:
            log = self.log_dir / f"{handle.ref.instance_id}.{handle.ref.attempt}.task.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_bytes(c.logs(stdout=True, stderr=True))
        c.remove(force=True)
        self._exited[handle.task_id] = code
        return code

    def exit_reason(self, handle: TaskHandle) -> str | None:
        return OOM_KILLED if handle.task_id in self._oom else None

    def stop(self, handle: TaskHandle) -> None:
        try:
            self.client.containers.get(handle.task_id).stop(timeout=10)
        except docker.errors.NotFound:
            pass

    def find_running(self, run: str) -> list[TaskHandle]:
        """The run's task containers still alive (after a dispatcher restart)."""
        found = self.client.containers.list(filters={"label": [f"{L_ROLE}=task", f"{L_RUN}={run}"]})
        return [TaskHandle(ref=AttemptRef(run=run, instance_id=c.labels[L_INSTANCE], attempt=int(c.labels[L_ATTEMPT])),
                           task_id=c.id) for c in found]

    def close(self, remove_network: bool = False) -> None:
        """Stop the host relays; with remove_network, also the egress and the network (no task may be left)."""
        if remove_network:
            self.egress.down()
        else:
            self.egress.stop_relays()
