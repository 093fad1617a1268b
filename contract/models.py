"""Pydantic models for every document and message that crosses a process boundary.

Data flows one way: spec -> Job (S3) -> task -> CallRecord / AttemptResult (results queue)
-> rows (PostgreSQL) -> EvalJob (eval queue) -> Verdict (verdict queue) -> rows. Who may send what: contract.signing.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def utcnow() -> datetime:
    return datetime.now(UTC)


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AttemptRef(Frozen):
    """Identity of one attempt: unique on (run, instance_id, attempt)."""

    run: str
    instance_id: str
    attempt: int = Field(ge=1)

    @property
    def slug(self) -> str:
        return f"{self.instance_id}/{self.attempt}"


# ---------------------------------------------------------------- outcomes


class HarnessOutcome(StrEnum):
    """How the harness phase of an attempt ended."""

    SUBMITTED = "submitted"
    BUDGET_EXCEEDED = "budget_exceeded"
    MAX_TURNS_EXCEEDED = "max_turns_exceeded"
    WALL_TIME_EXCEEDED = "wall_time_exceeded"
    HARNESS_ERROR = "harness_error"  # the harness itself failed (format errors, crash)
    INFRA_ERROR = "infra_error"  # our side failed (task died, upstream exhausted)
    CANCELLED = "cancelled"  # the run was cancelled (or the task stopped from outside) before it ended


OOM_KILLED = "oom_killed"  # the infra failure class of a task the kernel killed for memory (its error's head)
PROVIDER_OUTAGE = "provider_outage"  # ... of an attempt its pool's outage outlasted ([budget] outage_bound_s)
SPOT_INTERRUPTED = "spot_interrupted"  # ... of a task its Spot capacity was taken back from (relaunched once)


class AttemptStatus(StrEnum):
    """Lifecycle of an attempt row. Only PATCH_READY is not final."""

    PATCH_READY = "PATCH_READY"
    EMPTY_PATCH = "EMPTY_PATCH"
    RESOLVED = "RESOLVED"
    UNRESOLVED = "UNRESOLVED"
    EVAL_ERROR = "EVAL_ERROR"
    INFRA_ERROR = "INFRA_ERROR"  # our side failed (task setup, rate limits past retries, the grading environment)
    CANCELLED = "CANCELLED"

    @property
    def final(self) -> bool:
        return self is not AttemptStatus.PATCH_READY


class EvalOutcome(StrEnum):
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"
    APPLY_FAILED = "apply_failed"  # official ">>>>> Patch Apply Failed"
    TIMEOUT = "timeout"
    ERROR = "error"  # no valid test output (suite crashed, etc.)
    INFRA_ERROR = "infra_error"  # never scored as a model failure


# ---------------------------------------------------------------- job documents


class ModelRef(Frozen):
    provider: Literal["openai", "anthropic"]
    model: str
    pool: str
    alias: str | None = None  # the gateway's name for the pool, which calls are sent as (None: no gateway)


class HarnessRef(Frozen):
    name: str
    settings: dict[str, Any] = Field(default_factory=dict)


class AttemptLimits(Frozen):
    cost_usd: float | None = None
    max_turns: int | None = None
    wall_time_s: float | None = None  # the time the pool's outage breaker held its calls is not counted
    outage_bound_s: float | None = None  # an outage of the pool longer than this ends the attempt (None: never)


class TaskResources(Frozen):
    """A task's container resources as the spec sets them ([backend] task_cpu, task_memory, task_memory_limit):
    recorded with every attempt, since resources alone move scores."""

    cpu: float  # vCPUs
    memory_mib: int  # guaranteed
    memory_limit_mib: int  # the kill threshold


class ComputeUsage(BaseModel):
    """What an attempt's task used, as its own container counted it (harness/usage.py): its cgroup locally, the ECS
    task metadata endpoint on Fargate, or the runner's rusage where the task is a process on a shared host."""

    source: Literal["cgroup", "ecs", "rusage"]
    cpu_s: float | None = None
    memory_peak_bytes: int | None = None
    wall_s: float | None = None  # the task's life when it reported (its container's where known)


class Job(Frozen):
    """One attempt's job document, written to S3; the task is handed only its URI."""

    ref: AttemptRef
    harness: HarnessRef
    model: ModelRef
    limits: AttemptLimits
    run_cost_usd: float | None = None
    instance: dict[str, Any]  # the dataset row (problem_statement, repo, base_commit, ...)
    repo_source: str  # where the task gets the repository: contract.task_shape.TESTBED (baked into its task image)
    # or a git bundle's path (the process launcher clones it)
    bundle: str | None = None  # a git bundle of the repository, where one is known (the process grading backend's)
    upstream_url: str  # the gateway (or simulator) base URL the shim forwards to
    results_queue_url: str
    artifacts_prefix: str  # s3://bucket/runs/<run>/attempts/<iid>/<n>/
    valkey_url: str
    resources: TaskResources | None = None  # the task's, as the spec set them (echoed in its result)
    created_at: datetime = Field(default_factory=utcnow)


class EvalJob(Frozen):
    ref: AttemptRef
    model_name: str  # model_name_or_path in the official layout
    patch_uri: str
    instance: dict[str, Any]
    repo_source: str
    verdict_queue_url: str  # where the verdict goes (signed with the verdict key): only the eval fleet may send there
    artifacts_prefix: str
    timeout_s: float = 1800.0


# ---------------------------------------------------------------- ledger


class Usage(BaseModel):
    """Normalised token usage: input_tokens are uncached; the four add up to what was billed."""

    input_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
        )


class CallRecord(BaseModel):
    """One ledger row: one inference call as the shim saw it."""

    model_config = ConfigDict(extra="forbid")

    call_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    run: str
    instance_id: str
    attempt: int
    seq: int
    pool: str
    provider: str
    model: str
    route: str
    stream: bool = False
    started_at: datetime = Field(default_factory=utcnow)
    input_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    latency_ms: float = 0.0
    pacer_wait_ms: float = 0.0
    retries: int = 0
    http_status: int = 0
    outcome: str = "ok"  # ok | error | bad_request | budget_exceeded | max_turns_exceeded | stream_error | rate_limited | provider_outage
    usage_estimated: bool = False
    raw_usage: dict[str, Any] | None = None
    gateway_call_id: str | None = None  # the gateway's id of the call's last attempt (its x-litellm-call-id)
    held_ms: float = 0.0  # held by the pool's open outage breaker or the run's call hold (not in pacer_wait_ms)

    @property
    def usage(self) -> Usage:
        return Usage(
            input_tokens=self.input_tokens,
            cached_tokens=self.cached_tokens,
            cache_write_tokens=self.cache_write_tokens,
            output_tokens=self.output_tokens,
        )


class Totals(BaseModel):
    calls: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0

    def add(self, usage: Usage, cost_usd: float) -> None:
        """One more call."""
        self.calls += 1
        self.input_tokens += usage.input_tokens
        self.cached_tokens += usage.cached_tokens
        self.cache_write_tokens += usage.cache_write_tokens
        self.output_tokens += usage.output_tokens
        self.cost_usd = round(self.cost_usd + cost_usd, 9)

    @classmethod
    def of(cls, rows: list[CallRecord]) -> Totals:
        return cls(
            calls=len(rows),
            input_tokens=sum(r.input_tokens for r in rows),
            cached_tokens=sum(r.cached_tokens for r in rows),
            cache_write_tokens=sum(r.cache_write_tokens for r in rows),
            output_tokens=sum(r.output_tokens for r in rows),
            cost_usd=round(sum(r.cost_usd for r in rows), 9),
        )


# ---------------------------------------------------------------- results-queue messages


class LedgerBatch(BaseModel):
    kind: Literal["ledger"] = "ledger"
    ref: AttemptRef
    rows: list[CallRecord]


class AttemptResult(BaseModel):
    """Sent by the task when the harness phase ends (exactly one lands per attempt)."""

    kind: Literal["attempt_result"] = "attempt_result"
    ref: AttemptRef
    harness: str
    pool: str
    model: str
    outcome: HarnessOutcome
    patch_uri: str | None = None
    patch_bytes: int = 0
    trajectory_uri: str | None = None
    ledger_calls: int = 0  # how many ledger rows the attempt made (sent in batches or below)
    totals: Totals = Field(default_factory=Totals)
    started_at: datetime
    ended_at: datetime
    error: str | None = None
    resources: TaskResources | None = None
    usage: ComputeUsage | None = None
    # The ledger rows not yet sent when the harness ended ride with the result: one message instead of two at
    # every task's end (the writer lands them in the same transaction as the attempt row).
    ledger: list[CallRecord] = Field(default_factory=list)


class TamperFlag(Frozen):
    """A patch touched something grading reads (eval_worker.tamper): the rule, and the files it names. Shown beside
    the official verdict; the files of eval_worker.tamper.LEFT_OUT_RULES were not part of the graded patch."""

    rule: Literal["conftest", "pytest_config", "pytest_plugin", "pytest_hook", "test_file", "eval_input"]
    files: list[str]


class Verdict(BaseModel):
    """Sent by the eval worker (signed with the verdict key, on the verdict queue) when a patch has been graded."""

    kind: Literal["verdict"] = "verdict"
    ref: AttemptRef
    outcome: EvalOutcome
    resolved: bool
    report: dict[str, Any] = Field(default_factory=dict)  # the official per-instance report.json entry
    report_uri: str | None = None
    reason: str | None = None
    started_at: datetime
    ended_at: datetime
    tamper_flags: list[TamperFlag] = Field(default_factory=list)
    grading_cpu_s: float | None = None  # CPU-seconds the grading took, where the grader could count them


ResultMessage = Annotated[LedgerBatch | AttemptResult | Verdict, Field(discriminator="kind")]


class Envelope(BaseModel):
    """What goes on the results queue: exactly one message of a known kind."""

    msg: ResultMessage
