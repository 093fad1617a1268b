"""ECS RunTask: a Fargate task per harness attempt (awsvpc, no public IP), EC2-placed eval workers.

Batching: RunTask's `count` (at most 10) starts copies that share one `overrides`, and each attempt must
get its own job reference, so an attempt is one RunTask call with count=1; throughput comes from calling
concurrently (`launch_many`). Every task started counts against the account's launch quota (Fargate: about 20 tasks
a second, bursts of 100, per account and region), so RunTask is paced to it by a token bucket (one token a task)
instead of being throttled and backed off; `launch_room` says how many can start now without waiting. Eval workers
are interchangeable, so they do go 10 a call. Placement failures (`failures`, or fewer tasks than asked) are not lost: the attempt's handle stays
pending and is retried later (`retry_pending`, or on `poll`), the eval deficit likewise.

Every attempt runs its own task image (contract/task_shape.py): RunTask cannot override an image, so the attempt
runs the template's revision for its image (task_definitions.py: registered once per image digest, cached in
PostgreSQL across dispatchers, paced). Overrides carry only the job reference and the attempt's signing key: the
run's gateway key comes from the run's own Secrets Manager secret, which the run's revisions name in their container's
`secrets` (RunTask cannot override secrets, and DescribeTasks shows an environment override to anyone allowed to
call it). Tags and startedBy name run and attempt, so `find_running` rebuilds handles
after a restart.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from contract import task_shape
from contract.models import OOM_KILLED, SPOT_INTERRUPTED, AttemptRef, TaskResources
from dispatcher.backends.stack_outputs import StackOutputs
from dispatcher.launchers.base import (
    AttemptEnv,
    LaunchContext,
    Launcher,
    LaunchMeter,
    TaskHandle,
    no_attempt_env,
)
from dispatcher.launchers.task_definitions import (
    PgRevisionCache,
    RevisionCache,
    TaskImageError,
    TaskImageRevisions,
)
from plumbing.token_bucket import TokenBucket

log = logging.getLogger("evalplane.launchers.ecs")

PENDING = "pending"  # task_id of a handle whose attempt is not placed yet
MAX_COUNT = 10  # RunTask's limit of tasks per call
# Fargate's documented task launch rate per account and region (ECS service quotas): sustained, and burst
FARGATE_LAUNCH_RATE_PER_S, FARGATE_LAUNCH_BURST = 20.0, 100
DESCRIBE_BATCH = 100  # DescribeTasks' limit of tasks per call
THROTTLE_CODES = {"ThrottlingException", "Throttling", "TooManyRequestsException", "RequestLimitExceeded",
                  "ServerException"}
T_RUN, T_INSTANCE, T_ATTEMPT, T_ROLE = "evalplane:run", "evalplane:instance", "evalplane:attempt", "evalplane:role"


@dataclass(frozen=True)
class EcsTarget:
    """Where and how one kind of task runs."""

    cluster: str
    task_definition: str  # for harness attempts, the template each task image's revision is derived from
    container: str  # the container whose command carries the job reference
    launch_type: str = "FARGATE"
    subnets: tuple[str, ...] = ()
    security_groups: tuple[str, ...] = ()
    capacity: tuple[tuple[str, int], ...] = ()  # (capacity provider, weight): RunTask's strategy instead of a type

    def placement(self) -> dict[str, Any]:
        """launchType, or the capacity provider strategy (RunTask takes one of the two)."""
        if not self.capacity:
            return {"launchType": self.launch_type}
        return {"capacityProviderStrategy": [{"capacityProvider": p, "weight": w} for p, w in self.capacity]}

    def network(self) -> dict[str, Any]:
        if not self.subnets:
            return {}
        return {"networkConfiguration": {"awsvpcConfiguration": {
            "subnets": list(self.subnets), "securityGroups": list(self.security_groups),
            "assignPublicIp": "DISABLED"}}}


def _environment(env: dict[str, str]) -> dict[str, Any]:
    """A container override's environment entry (none when empty)."""
    return {"environment": [{"name": k, "value": v} for k, v in env.items()]} if env else {}


def started_by(run: str) -> str:
    """startedBy allows 128 of [A-Za-z0-9_/-]."""
    return ("evalplane/" + re.sub(r"[^A-Za-z0-9_/-]", "-", run))[:128]


def exit_code(task: dict, container: str) -> int | None:
    """None until STOPPED; then the container's exit code, or -1 if it never produced one."""
    if task.get("lastStatus") != "STOPPED":
        return None
    for c in task.get("containers", []):
        if c.get("name") == container and c.get("exitCode") is not None:
            return int(c["exitCode"])
    return -1


# Fargate's task sizes: CPU units -> (smallest memory MiB, largest, step)
FARGATE_SIZES = {256: (512, 2048, None), 512: (1024, 4096, 1024), 1024: (2048, 8192, 1024),
                 2048: (4096, 16384, 1024), 4096: (8192, 30720, 1024), 8192: (16384, 61440, 4096),
                 16384: (32768, 122880, 8192)}


def fargate_size_problem(res: TaskResources) -> str | None:
    """Why Fargate cannot size a task so (its CPU and its memory limit, the task's size), naming the field."""
    units = round(res.cpu * 1024)
    if units not in FARGATE_SIZES:
        return (f"backend.task_cpu: Fargate runs tasks of {', '.join(f'{u / 1024:g}' for u in FARGATE_SIZES)} vCPUs,"
                f" not {res.cpu:g}")
    lo, hi, step = FARGATE_SIZES[units]
    mem = res.memory_limit_mib
    ok = lo <= mem <= hi and (mem in (512, 1024, 2048) if step is None else mem % step == 0)
    if not ok:
        return (f"backend.task_memory_limit: a Fargate task of {res.cpu:g} vCPU is sized {lo}-{hi} MiB"
                f"{'' if step is None else f' in steps of {step}'} (its size is the memory limit: {mem} MiB)")
    return None


def sized(res: TaskResources | None, container: str, rest: dict[str, Any]) -> dict[str, Any]:
    """RunTask overrides for a task of these resources: the task's size (cpu, memory: what Fargate bills), and its
    container's guarantee (memoryReservation) and kill threshold (memory)."""
    if res is None:
        return {"containerOverrides": [{"name": container, **rest}]}
    return {"cpu": str(round(res.cpu * 1024)), "memory": str(res.memory_limit_mib),
            "containerOverrides": [{"name": container, "cpu": round(res.cpu * 1024),
                                    "memory": res.memory_limit_mib, "memoryReservation": res.memory_mib, **rest}]}


def spot_strategy(share: float) -> tuple[tuple[str, int], ...]:
    """The capacity provider strategy that puts `share` of the tasks on Fargate Spot (none: launchType FARGATE)."""
    spot = round(share * 100)
    return tuple((p, w) for p, w in (("FARGATE_SPOT", spot), ("FARGATE", 100 - spot)) if w) if spot else ()


SPOT_STOP_CODE, SPOT_STOP_REASON = "SpotInterruption", "Your Spot Task was interrupted"  # what ECS records
CAPACITY_OF = {"FARGATE_SPOT": "spot", "FARGATE": "on_demand"}  # capacity provider -> the price table's capacity


def placed_on(task: dict, target: EcsTarget) -> str | None:
    """The capacity a placed task runs on: its capacityProviderName, else what its target allows (one provider, or
    a launch type), else None (unknown: the price table's default prices it)."""
    name = task.get("capacityProviderName")
    if not name and len(target.capacity) == 1:
        name = target.capacity[0][0]
    if not name and not target.capacity:
        name = task.get("launchType") or target.launch_type
    return CAPACITY_OF.get(name or "")


def stop_reason(task: dict, container: str) -> str | None:
    """The infrastructure failure class of a stopped task, where ECS says one: OutOfMemoryError -> oom_killed, a
    Spot interruption (its stop code, or its stopped reason) -> spot_interrupted."""
    reasons = [task.get("stoppedReason") or ""] + [c.get("reason") or "" for c in task.get("containers", [])
                                                   if c.get("name") == container]
    if any("OutOfMemoryError" in r for r in reasons):
        return OOM_KILLED
    if task.get("stopCode") == SPOT_STOP_CODE or SPOT_STOP_REASON in reasons[0]:
        return SPOT_INTERRUPTED
    return None


@dataclass
class _Pending:
    handle: TaskHandle
    job_uri: str
    task_definition: str  # the revision of the attempt's task image
    next_try: float
    tries: int = 0


@dataclass
class _EvalDeficit:
    count: int = 0
    next_try: float = 0.0
    tries: int = field(default=0)


class EcsLauncher(Launcher):
    backend = "aws"
    task_images = True
    paced = True

    @classmethod
    def create(cls, ctx: LaunchContext) -> EcsLauncher:
        """From the run's estate (its backend's stack outputs). The run's gateway key (the backend's task_secrets,
        made by its open_gateway) and Valkey's harness user reach tasks from Secrets Manager through their task
        definition; the attempt key rides in each RunTask's environment override."""
        spec = ctx.plan.spec
        return cls.from_stack_outputs(ctx.backend.outputs, spec.backend.spot,
                                      launch_rate_per_s=spec.backend.launch_rate_per_s,
                                      launch_burst=spec.backend.launch_burst, attempt_env=ctx.attempt_env,
                                      resources=spec.backend.resources, secrets=ctx.backend.task_secrets)

    @classmethod
    def problem(cls, spec) -> str | None:
        return fargate_size_problem(spec.backend.resources)

    def __init__(self, harness: EcsTarget, eval_workers: EcsTarget | None = None, *, client=None,
                 region: str | None = None, deadline_tag: str | None = None, deadline: datetime | None = None,
                 poll_interval_s: float = 5.0, retry_interval_s: float = 15.0, backoff_base_s: float = 0.5,
                 max_throttle_tries: int = 10, launch_workers: int = 8, sleep: Callable[[float], None] = time.sleep,
                 revision_cache: RevisionCache | None = None, register_rate_per_s: float = 1.0,
                 register_burst: int = 5, launch_rate_per_s: float = FARGATE_LAUNCH_RATE_PER_S,
                 launch_burst: int = FARGATE_LAUNCH_BURST, attempt_env: AttemptEnv = no_attempt_env,
                 resources: TaskResources | None = None, secrets: dict[str, str] | None = None):
        """revision_cache: where task-image revisions are shared between dispatchers (default: the
        `task_definitions` table in DATABASE_URL); register_rate_per_s, register_burst: the pace of
        RegisterTaskDefinition calls; launch_rate_per_s, launch_burst: the account's task launch quota RunTask is
        paced to (tasks a second, and the burst); attempt_env(ref): the environment one attempt's task gets in its
        RunTask override (its attempt key; its other secrets come from the task definition); resources: each task's
        size and its container's memory guarantee and limit, as RunTask overrides (None: the task definition's);
        secrets: what the run's revisions add to the container's secrets (env name -> secret ARN: its gateway key)."""
        self.attempt_env = attempt_env
        self.resources = resources
        self.harness, self.eval = harness, eval_workers
        self.ecs = client or boto3.client("ecs", region_name=region, config=Config(
            retries={"mode": "adaptive", "max_attempts": 5}, max_pool_connections=max(10, launch_workers * 2)))
        self.deadline_tag, self.deadline = deadline_tag, deadline
        self.poll_interval_s, self.retry_interval_s = poll_interval_s, retry_interval_s
        self.backoff_base_s, self.max_throttle_tries = backoff_base_s, max_throttle_tries
        self.launch_workers = launch_workers
        self._sleep = sleep
        self._lock = threading.Lock()
        self._pending: dict[AttemptRef, _Pending] = {}
        self._live: set[str] = set()  # task ARNs not yet seen STOPPED
        self._codes: dict[str, int] = {}  # ARN -> exit code, once STOPPED
        self._reasons: dict[str, str] = {}  # ARN -> the infrastructure failure class ECS gave for its stop
        self._cancelled: set[AttemptRef] = set()
        self._refreshed = 0.0
        self.eval_deficit = _EvalDeficit()
        self._eval_run: str | None = None
        self._eval_command: list[str] | None = None
        self.revisions = TaskImageRevisions(
            harness.task_definition, harness.container, revision_cache or PgRevisionCache(), self._call,
            TokenBucket(register_rate_per_s, register_burst, sleep=sleep), secrets)
        self.launch_pace = TokenBucket(launch_rate_per_s, launch_burst, sleep=sleep)
        self.meter = LaunchMeter()

    @classmethod
    def from_stack_outputs(cls, out: StackOutputs, spot: float = 0.0, **kw) -> EcsLauncher:
        """spot: the share of harness tasks on Fargate Spot (the estate's cluster has both capacity providers)."""
        harness = EcsTarget(out.cluster_arn, out.harness_task_definition_arn, task_shape.CONTAINER, "FARGATE",
                            tuple(out.harness_subnet_ids), (out.harness_security_group_id,), spot_strategy(spot))
        eval_workers = EcsTarget(out.eval_cluster_arn, out.eval_task_definition_arn, "eval-worker", "EC2")
        kw.setdefault("region", out.region)
        return cls(harness, eval_workers, deadline_tag=out.deadline_tag, **kw)

    def launch_room(self) -> int:
        """Tasks the launch quota lets start now without waiting (the driver launches no more in one pass)."""
        return self.launch_pace.available()

    def launch_report(self) -> str:
        return (f"ecs launcher, paced to {self.launch_pace.rate:g} tasks/s (burst {self.launch_pace.burst:g}): "
                f"{self.meter.report()}")

    # ------------------------------------------------------------------ API calls
    def _call(self, op: str, **kw) -> dict:
        """One ECS call, backing off (full jitter) on throttling that outlived botocore's own retries."""
        for i in range(self.max_throttle_tries):
            try:
                return getattr(self.ecs, op)(**kw)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in THROTTLE_CODES or i == self.max_throttle_tries - 1:
                    raise
                delay = random.uniform(0, min(20.0, self.backoff_base_s * 2 ** i))
                log.warning("ecs %s throttled (%s); retrying in %.2fs", op, e.response["Error"]["Code"], delay)
                self._sleep(delay)
        raise AssertionError("unreachable")

    def _tags(self, role: str, ref: AttemptRef | None = None, run: str | None = None) -> list[dict]:
        tags = {T_ROLE: role}
        if ref is not None:
            tags |= {T_RUN: ref.run, T_INSTANCE: ref.instance_id, T_ATTEMPT: str(ref.attempt)}
        elif run:
            tags[T_RUN] = run
        if self.deadline_tag and self.deadline:
            tags[self.deadline_tag] = self.deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
        return [{"key": k, "value": v} for k, v in tags.items()]

    # ------------------------------------------------------------------ harness attempts
    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        """Start the attempt's task from its task image (required: by digest); if it cannot be placed now, a
        pending handle that is retried later."""
        try:
            task_definition = self.revisions.arn(image)
        except TaskImageError as e:
            raise TaskImageError(f"attempt {ref.slug}: {e}") from None
        handle = TaskHandle(ref=ref, task_id=PENDING)
        self._try(_Pending(handle, job_uri, task_definition, 0.0))
        return handle

    def launch_many(self, items: list[tuple[AttemptRef, str, str]]) -> list[TaskHandle]:
        """launch() for many (attempt, job URI, task image), concurrently (one RunTask each: overrides are per call)."""
        with ThreadPoolExecutor(self.launch_workers) as pool:
            return list(pool.map(lambda it: self.launch(*it), items))

    def _try(self, p: _Pending) -> bool:
        ref = p.handle.ref
        self.launch_pace.acquire()
        with self.meter.timed():
            resp = self._call(
                "run_task", cluster=self.harness.cluster, taskDefinition=p.task_definition, count=1,
                **self.harness.placement(), startedBy=started_by(ref.run),
                group=f"evalplane:{ref.run}"[:255],
                overrides=sized(self.resources, self.harness.container,
                                {"command": [p.job_uri], **_environment(self.attempt_env(ref))}),
                tags=self._tags("harness", ref), **self.harness.network(),
            )
        tasks = resp.get("tasks", [])
        with self._lock:
            if tasks:
                p.handle.task_id = tasks[0]["taskArn"]
                p.handle.capacity = placed_on(tasks[0], self.harness)
                self._live.add(p.handle.task_id)
                self._pending.pop(ref, None)
                return True
            p.tries += 1
            p.next_try = time.monotonic() + min(300.0, self.retry_interval_s * 2 ** min(p.tries - 1, 5))
            self._pending[ref] = p
        log.info("attempt %s not placed (%s); retrying later", ref.slug,
                 "; ".join(f.get("reason", "?") for f in resp.get("failures", [])) or "no capacity")
        return False

    def retry_pending(self, force: bool = False) -> int:
        """Retry the attempts (and eval workers) that could not be placed and are due. Returns tasks placed."""
        now = time.monotonic()
        with self._lock:
            due = [p for p in self._pending.values() if force or p.next_try <= now]
        placed = sum(1 for p in due if p.handle.ref not in self._cancelled and self._try(p))
        if self.eval_deficit.count and (force or self.eval_deficit.next_try <= now):
            n = self.eval_deficit.count
            self.eval_deficit.count = 0
            placed += len(self.launch_eval_workers(n))
        return placed

    @property
    def pending(self) -> list[TaskHandle]:
        with self._lock:
            return [p.handle for p in self._pending.values()]

    def poll(self, handle: TaskHandle) -> int | None:
        if handle.ref in self._cancelled and handle.task_id == PENDING:
            return -1
        if handle.task_id == PENDING:
            p = self._pending.get(handle.ref)
            if p is not None and p.next_try <= time.monotonic():
                self._try(p)
            return None
        if handle.task_id not in self._codes:
            self._live.add(handle.task_id)
            if time.monotonic() - self._refreshed >= self.poll_interval_s:
                self.refresh()
        return self._codes.get(handle.task_id)

    def refresh(self) -> None:
        """DescribeTasks for every live task, 100 a call: the poll answers come from here."""
        self._refreshed = time.monotonic()
        live = sorted(self._live)
        for i in range(0, len(live), DESCRIBE_BATCH):
            resp = self._call("describe_tasks", cluster=self.harness.cluster, tasks=live[i:i + DESCRIBE_BATCH])
            for t in resp.get("tasks", []):
                code = exit_code(t, self.harness.container)
                if code is not None:
                    self._codes[t["taskArn"]] = code
                    if reason := stop_reason(t, self.harness.container):
                        self._reasons[t["taskArn"]] = reason
                    self._live.discard(t["taskArn"])
            for f in resp.get("failures", []):  # MISSING: the task is gone (long stopped)
                if f.get("arn") in self._live and f.get("reason") == "MISSING":
                    self._codes[f["arn"]] = -1
                    self._live.discard(f["arn"])

    def exit_reason(self, handle: TaskHandle) -> str | None:
        return self._reasons.get(handle.task_id)

    def stop(self, handle: TaskHandle) -> None:
        if handle.task_id == PENDING:
            with self._lock:
                self._pending.pop(handle.ref, None)
                self._cancelled.add(handle.ref)
            return
        self._call("stop_task", cluster=self.harness.cluster, task=handle.task_id, reason="evalplane: stopped")
        self._refreshed = 0.0

    def find_running(self, run: str) -> list[TaskHandle]:
        """The run's tasks that are not stopped, from startedBy and the attempt tags."""
        arns: list[str] = []
        for status in ("RUNNING", "PENDING"):
            kw: dict[str, Any] = {"cluster": self.harness.cluster, "startedBy": started_by(run), "desiredStatus": status}
            while True:
                resp = self._call("list_tasks", **kw)
                arns += resp.get("taskArns", [])
                if not resp.get("nextToken"):
                    break
                kw["nextToken"] = resp["nextToken"]
        handles = []
        for i in range(0, len(arns), DESCRIBE_BATCH):
            resp = self._call("describe_tasks", cluster=self.harness.cluster, tasks=arns[i:i + DESCRIBE_BATCH],
                              include=["TAGS"])
            for t in resp.get("tasks", []):
                tags = {x["key"]: x["value"] for x in t.get("tags", [])}
                if tags.get(T_RUN) != run or T_INSTANCE not in tags or t.get("lastStatus") == "STOPPED":
                    continue
                self._live.add(t["taskArn"])
                ref = AttemptRef(run=run, instance_id=tags[T_INSTANCE], attempt=int(tags[T_ATTEMPT]))
                handles.append(TaskHandle(ref=ref, task_id=t["taskArn"]))
        return handles

    # ------------------------------------------------------------------ eval workers
    def launch_eval_workers(self, n: int, run: str | None = None, command: list[str] | None = None) -> list[str]:
        """n eval workers on the EC2 eval cluster, 10 a RunTask; those not placed are retried later (with the same
        run and command: the worker's arguments, e.g. its run's eval queue, are the only override)."""
        if self.eval is None:
            raise RuntimeError("no eval target configured")
        if run is not None:
            self._eval_run = run
        if command is not None:
            self._eval_command = command
        run, command = self._eval_run, self._eval_command
        overrides = {"overrides": {"containerOverrides": [{"name": self.eval.container, "command": command}]}} \
            if command else {}
        arns: list[str] = []
        for k in [MAX_COUNT] * (n // MAX_COUNT) + ([n % MAX_COUNT] if n % MAX_COUNT else []):
            self.launch_pace.acquire(k)
            resp = self._call("run_task", cluster=self.eval.cluster, taskDefinition=self.eval.task_definition,
                              count=k, launchType=self.eval.launch_type, startedBy="evalplane/eval-worker",
                              tags=self._tags("eval-worker", run=run), **self.eval.network(), **overrides)
            got = [t["taskArn"] for t in resp.get("tasks", [])]
            arns += got
            if len(got) < k:
                self.eval_deficit.count += k - len(got)
        if len(arns) < n:
            self.eval_deficit.tries += 1
            self.eval_deficit.next_try = time.monotonic() + self.retry_interval_s
            log.info("%d of %d eval workers placed; the rest are retried later", len(arns), n)
        else:
            self.eval_deficit.tries = 0
        return arns
