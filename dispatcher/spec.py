"""spec.toml -> validated pydantic models. Every mistake is reported with its field path and TOML line."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


def _beside_spec(v: str, info: ValidationInfo) -> Path:
    """A path as the spec gives it: absolute, or relative to the spec file's folder."""
    p = Path(v)
    return p if p.is_absolute() else Path((info.context or {}).get("base_dir", ".")) / p


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSpec(Strict):
    name: str = Field(description="Run name: lower-case letters, digits and dashes; the resume key")
    attempts: int = Field(1, ge=1, le=100, description="Attempts per instance")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not RUN_NAME.match(v):
            raise ValueError("must be 1-40 characters of a-z, 0-9 and '-', starting with a letter or digit")
        return v


def registered(registry, name: str | None) -> str | None:
    """A spec field naming a seam (harness, backend, launcher, grader): registered, or a dotted path that loads."""
    from plumbing.registry import UnknownName

    if name is not None:
        try:
            registry.get(name)
        except UnknownName as e:  # the registry's message: the choices, or why the dotted path did not load
            raise ValueError(str(e)) from None
    return name


class HarnessSpec(Strict):
    name: str = Field(description=(
        "a registered harness (harness.adapters.ADAPTERS) or a dotted path 'package.module:Class' to an adapter"))
    settings: dict[str, Any] = Field(default_factory=dict, description=(
        "harness-specific, validated against the adapter's Settings model"))

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from harness.adapters import ADAPTERS

        return registered(ADAPTERS, v)

    @model_validator(mode="after")
    def _settings(self) -> HarnessSpec:
        from harness.adapters import load_adapter

        try:
            load_adapter(self.name).Settings.model_validate(self.settings)
        except ValidationError as e:  # each problem under harness.settings.<field> (see load_spec)
            raise SettingsInvalid(e) from None
        return self

    @property
    def adapter(self):
        from harness.adapters import load_adapter

        return load_adapter(self.name)


class SettingsInvalid(ValueError):
    """The [harness] settings do not fit the adapter's Settings model; load_spec reports each field."""

    def __init__(self, error: ValidationError):
        self.error = error
        super().__init__("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in error.errors()))


class ModelSpec(Strict):
    provider: Literal["openai", "anthropic"]
    model: str = Field(min_length=1)
    pool: str | None = Field(None, description="Pool alias; default '<model>@<harness>'")
    api_key_env: str = Field("EVALPLANE_UPSTREAM_KEY", description="Env var holding the run's provider key")
    base_url: str | None = Field(None, description=(
        "the provider's endpoint (behind the gateway tier with [gateway], else what the shims call); unset with"
        " backend local = the simulator"))
    max_tokens: int = Field(4096, ge=1)
    rpm: int | None = Field(None, ge=1, description="Pool limits, until discovered from headers")
    itpm: int | None = Field(None, ge=1)
    otpm: int | None = Field(None, ge=1)


class InstancesSpec(Strict):
    dataset: str = Field(description="A .jsonl/.json/.parquet file (relative to the spec) or a known dataset name")
    split: str = "test"
    ids: list[str] | None = None
    filter: dict[str, str | list[str]] | None = Field(None, description="field = value or [values]")
    slice: str | None = Field(None, description="Python-style 'start:stop' over the filtered rows")
    repos: str | None = Field(None, description=(
        "Folder of git bundles '<owner>__<name>.bundle': what the process launcher clones and the process grading "
        "backend grades in; with the docker launcher, where an instance image is missing, a SWE-bench-shaped "
        "stand-in is built from its bundle"))

    @field_validator("slice")
    @classmethod
    def _slice(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"-?\d*:-?\d*", v):
            raise ValueError("must look like 'start:stop', e.g. '0:10' or ':5'")
        return v

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str, info: ValidationInfo) -> str:
        from dispatcher.instances import resolve_dataset

        return str(resolve_dataset(v, base=(info.context or {}).get("base_dir")))

    @field_validator("repos")
    @classmethod
    def _repos(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        p = _beside_spec(v, info)
        if not p.is_dir():
            raise ValueError(f"folder not found: {p}")
        return str(p.resolve())


class BudgetSpec(Strict):
    run_usd: float = Field(gt=0, description="Cap on the whole run's spend")
    attempt_usd: float | None = Field(None, gt=0)
    max_turns: int | None = Field(None, ge=1)
    wall_time_s: float = Field(1800, gt=0, description=(
        "Wall-time limit of one attempt's harness phase (the time a provider outage held its calls not counted)"))
    outage_bound_s: float = Field(600, gt=0, description=(
        "A provider outage (the pool's breaker open) longer than this ends the attempts it holds as infra_error "
        "(provider_outage); a shorter one only holds their calls"))


_MIB = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_MIB_PER = {"k": 1 / 1024, "": 1, "m": 1, "g": 1024, "t": 1024 * 1024}


def mebibytes(v: Any) -> Any:
    """A memory size as the spec may write it: MiB as a number, or "512m", "4g", "4GiB"."""
    if isinstance(v, str):
        m = _MIB.match(v)
        if m is None:
            raise ValueError(f"{v!r} is not a memory size: MiB as a number, or a size like \"512m\" or \"4g\"")
        return int(float(m.group(1)) * _MIB_PER[m.group(2).lower()])
    return v


MiB = Annotated[int, BeforeValidator(mebibytes), Field(ge=64, le=120 * 1024)]


class BackendSpec(Strict):
    kind: str = Field("local", description=(
        "a registered backend (dispatcher.backends.BACKENDS: local, aws) or a dotted path 'package.module:Class' to "
        "a Backend subclass"))
    concurrency: int = Field(4, ge=1, le=20000)
    launcher: str | None = Field(
        None, description="a registered launcher (dispatcher.launchers.LAUNCHERS) or a dotted path "
                          "'package.module:Class' to a Launcher subclass. local: process (a subprocess per task, "
                          "repositories from instances.repos) or docker (a container per task from its task image on "
                          "the local Docker engine); aws: ecs. Default: process locally, or docker for a harness "
                          "installed only in its image layer (the npm harnesses); ecs on aws")
    stack_outputs: str | None = Field(None, description="`pulumi stack output --json` file (backend aws)")
    isolate_agent: bool = Field(True, description=(
        "run the harness as an unprivileged user of its own (harness/sandbox.py), apart from the task runner and "
        "the shim that hold the run's secrets. false is UNSAFE: the agent's commands can then read the provider "
        "key and every credential of the task; only for a process launcher that cannot run as root"))
    dashboard: bool = Field(False, description=(
        "Serve the live dashboard from the driver while the run goes (port 8270, EVALPLANE_DASHBOARD_PORT) and "
        "start the Ray dashboard with the local Ray cluster"))
    writers: int | None = Field(None, ge=1, le=64, description=(
        "results writer actors consuming the run's results queue (default: one per 250 concurrent tasks, at least"
        " 1, at most 8)"))
    result_wait_s: float = Field(300, gt=0, description=(
        "the longest an attempt's row may take to land once its task is gone (after it reported its result sent);"
        " then the driver resolves it: its result from the task's S3 copy, else infra_error (lost_result) with the"
        " ledger rows of the task's S3 ledger copy"))
    launch_rate_per_s: float = Field(20.0, gt=0, le=1000, description=(
        "backend aws: task launches a second RunTask is paced to (default: Fargate's documented rate per account"
        " and region)"))
    launch_burst: int = Field(100, ge=1, le=10000, description="backend aws: launches allowed at once above the rate")
    task_cpu: float = Field(1.0, gt=0, le=16, description=(
        "vCPUs each task is given (docker: nano_cpus; ecs: the task's cpu). Recorded with every attempt"))
    task_memory: MiB = Field(4096, description=(
        "memory each task is guaranteed, in MiB or as \"4g\" (docker: mem_reservation; ecs: memoryReservation)."
        " Recorded with every attempt"))
    task_memory_limit: MiB | None = Field(None, description=(
        "memory at which a task is killed (docker: mem_limit; ecs: the container's memory and the task's size);"
        " a task killed there lands infra_error (oom_killed), never the model's failure. Default: task_memory"))
    spot: float = Field(0.0, ge=0, le=1, description=(
        "backend aws: the share of harness tasks run on Fargate Spot (RunTask's capacity provider strategy, FARGATE_SPOT"
        " weighted against FARGATE); a task Spot takes back lands infra_error (spot_interrupted) and is relaunched"
        " once as a new attempt while the run's budget remains"))

    @field_validator("kind")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        from dispatcher.backends import BACKENDS

        return registered(BACKENDS, v)

    @field_validator("launcher")
    @classmethod
    def _known_launcher(cls, v: str | None) -> str | None:
        from dispatcher.launchers import LAUNCHERS

        return registered(LAUNCHERS, v)

    @property
    def backend_class(self):
        from dispatcher.backends import BACKENDS

        return BACKENDS.get(self.kind)

    @property
    def launcher_class(self):
        from dispatcher.launchers import LAUNCHERS

        return LAUNCHERS.get(self.launcher)

    @property
    def in_task_images(self) -> bool:
        """Tasks run in task images (their launcher's say: docker, ecs), not as local processes on a checkout."""
        return self.launcher_class.task_images

    @property
    def writer_count(self) -> int:
        return self.writers or min(8, max(1, -(-self.concurrency // 250)))

    @field_validator("stack_outputs")
    @classmethod
    def _outputs_file(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        p = _beside_spec(v, info)
        if not p.is_file():
            raise ValueError(f"stack outputs file not found: {p} (write it with `pulumi stack output --json`)")
        return str(p.resolve())

    @property
    def resources(self):
        """The task's resources as every attempt records them."""
        from contract.models import TaskResources

        return TaskResources(cpu=self.task_cpu, memory_mib=self.task_memory,
                             memory_limit_mib=self.task_memory_limit or self.task_memory)

    @model_validator(mode="after")
    def _backend_needs(self) -> BackendSpec:
        if self.task_memory_limit is not None and self.task_memory_limit < self.task_memory:
            raise PydanticCustomError("spec_field", (
                "task_memory_limit ({limit} MiB) is below task_memory ({memory} MiB): the limit is where a task is "
                "killed, the guarantee cannot be above it"), {"limit": self.task_memory_limit,
                                                               "memory": self.task_memory,
                                                               "field": "backend.task_memory_limit"})
        if problem := self.backend_class.spec_problem(self):  # e.g. aws: its stack outputs
            raise ValueError(problem)
        return self


class ImagesSpec(Strict):
    """Where task images go, and where the instances' official images come from (both pulled by digest)."""

    registry: str | None = Field(None, description=(
        "HOST[:PORT] of the registry task images are pushed to and run from; unset: the local engine only. "
        "backend aws: the estate's ECR from the stack outputs"))
    repository: str = Field("evalplane/task", pattern=r"^[a-z0-9]+([._/-][a-z0-9]+)*$", description=(
        "the repository task images are tagged and pushed under (backend aws: the estate's, from the stack outputs)"))
    instance_registry: str | None = Field(None, description=(
        "HOST[:PORT] of the private registry the official instance images are mirrored to "
        "(python -m eval_worker mirror); unset: images present in the local engine"))
    build_parallel: int = Field(4, ge=1, le=64, description=(
        "how many task images `python -m dispatcher images` builds at once (`--parallel` overrides it)"))


class EvalSpec(Strict):
    backend: str | None = Field(None, description=(
        "the grader (eval_worker.graders.GRADERS): docker: the official run_instance in the instance image (official "
        "results); process: a local sandbox cloned from the instance's bundle (no Docker; an approximation); or a "
        "dotted path 'package.module:Class' to a Grader. Default: docker where tasks run in task images (backend "
        "aws, or launcher docker), else process"))
    require_validated: Literal["off", "exclude", "refuse"] = Field(
        "off", description="instances whose image has no valid gold validation: run anyway, exclude, or refuse")
    workers: int = Field(1, ge=1, le=1000)
    timeout_s: float = Field(1800, gt=0)
    verdict_wait_s: float = Field(300, gt=0, description=(
        "the longest a patch's verdict may take to land once no eval job of the run is waiting or held by a grader"
        " (and this long after its job was sent); then the attempt lands as infra_error (verdict_lost), as it does"
        " when its eval job reaches the eval dead-letter queue"))

    @field_validator("backend")
    @classmethod
    def _known_grader(cls, v: str | None) -> str | None:
        from eval_worker.graders import GRADERS

        return registered(GRADERS, v)


class SimulatorSpec(Strict):
    """The provider simulator the local backend starts when model.base_url is unset."""

    policy: str = Field("echo", description="'echo' or a demo policy JSON file (relative to the spec)")
    rpm: int | None = Field(None, ge=1)
    itpm: int | None = Field(None, ge=1)
    otpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    error_rate: float = Field(0.0, ge=0, le=1)
    error_statuses: list[Literal[429, 500, 503, 529]] | None = Field(
        None, min_length=1, description="the statuses injected errors answer with (default: 429, 529, 503)")
    seed: int | None = Field(None, description="seed for the injected errors' dice: the same faults in the same order")
    outage_at_s: float | None = Field(None, ge=0, description="a provider outage from this many seconds after start")
    outage_s: float = Field(0.0, ge=0, description="... lasting this long")
    outage_after_calls: int | None = Field(None, ge=0, description="... or from the request after this many")
    outage_status: Literal[0, 500, 503, 529] = Field(503, description="... answering this (0: connections dropped)")

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str, info: ValidationInfo) -> str:
        if v == "echo":
            return v
        p = _beside_spec(v, info)
        if not p.is_file():
            raise ValueError(f"policy file not found: {p}")
        return str(p.resolve())


class GatewaySpec(Strict):
    """The gateway tier between the tasks' shims and the provider (gateway/; docs/gateway.md): present = on. Tasks
    then hold the run's gateway key, never the provider key."""

    replicas: int = Field(2, ge=1, le=8, description="LiteLLM replicas behind the balancer (backend local)")
    replica_calls_per_s: float = Field(40.0, gt=0, description=(
        "calls per second one replica serves flat out, which `plan` sizes the tier from (half of it per replica):"
        " bench/bench_gateway.py measures it on your hardware"))
    key_ttl_s: float = Field(7 * 24 * 3600, gt=0, description=(
        "the run's gateway key expires this long after it is minted (a resumed run mints it again)"))
    provider_keys: str | None = Field(None, description=(
        "a registered ProviderKeys (dispatcher.provider_keys.PROVIDER_KEYS: simulator, openrouter) or a dotted path to one: the"
        " run gets a provider key of its own whose spend limit is budget.run_usd, enforced by the provider. Default:"
        " simulator when the run's provider is its own simulator, else none (the gateway key's budget is the cap)"))

    @field_validator("provider_keys")
    @classmethod
    def _known_provider_keys(cls, v: str | None) -> str | None:
        from dispatcher.provider_keys import PROVIDER_KEYS

        return registered(PROVIDER_KEYS, v)


class Spec(Strict):
    run: RunSpec
    harness: HarnessSpec
    model: ModelSpec
    instances: InstancesSpec
    budget: BudgetSpec
    backend: BackendSpec = Field(default_factory=BackendSpec)
    images: ImagesSpec = Field(default_factory=ImagesSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    simulator: SimulatorSpec | None = None
    gateway: GatewaySpec | None = None
    _source: dict = PrivateAttr(default_factory=dict)  # the spec as written (before paths were resolved)

    @model_validator(mode="after")
    def _eval_backend_follows_tasks(self) -> Spec:
        adapter, backend = self.harness.adapter, self.backend.backend_class
        if self.backend.launcher is None:
            self.backend.launcher = backend.default_launcher(adapter)
        elif not backend.runs(self.backend.launcher_class):
            raise PydanticCustomError("spec_field", (
                "the {kind} backend does not run tasks with the launcher {launcher}: one of {choices}, or a dotted "
                "path to a Launcher of its own"), {"kind": self.backend.kind, "launcher": self.backend.launcher,
                                                   "choices": ", ".join(backend.launchers), "field": "backend.launcher"})
        elif adapter.needs_image and not self.backend.in_task_images:
            raise PydanticCustomError("spec_field", (
                "harness {harness} is installed only in its task image layer; use launcher = \"docker\" (or leave it "
                "unset)"), {"harness": self.harness.name, "field": "backend.launcher"})
        # Through the gateway any harness takes any model it serves: the harness speaks its own wire format to the
        # shim and the gateway, which translates to the deployment's (docs/gateway.md)
        if self.model.provider not in adapter.providers and self.gateway is None:
            raise PydanticCustomError("spec_field", (
                "harness {harness} speaks only to {providers}; with [gateway] it takes a model of any provider the "
                "gateway serves"), {"harness": self.harness.name, "providers": " or ".join(adapter.providers),
                                    "field": "model.provider"})
        if self.eval.backend is None:
            self.eval.backend = "docker" if self.backend.in_task_images else "process"
        return self

    @property
    def source(self) -> dict:
        return self._source

    @property
    def pool(self) -> str:
        return self.model.pool or f"{self.model.model}@{self.harness.name}"

    @property
    def provider_keys(self) -> str | None:
        """The ProviderKeys whose key per run holds the run's cap (None: no gateway tier, or a provider without
        one: the gateway key's budget holds it)."""
        if self.gateway is None:
            return None
        return self.gateway.provider_keys or (None if self.model.base_url else "simulator")

    def cap_holder(self) -> str:
        """What enforces budget.run_usd besides the shims' reservation, in words (forecast prints it)."""
        if self.gateway is None:
            return "the shims' reservation alone (no [gateway])"
        if self.provider_keys:
            return f"the spend limit of the run's own provider key ({self.provider_keys}), behind the shims' reservation"
        return "the gateway key's budget (no ProviderKeys for this provider), behind the shims' reservation"


# ---------------------------------------------------------------- errors


class SpecProblem(BaseModel):
    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"{self.path}{where}: {self.message}"


class SpecError(Exception):
    def __init__(self, file: str, problems: list[SpecProblem]):
        self.file, self.problems = file, problems
        super().__init__("\n".join(f"{file}: {p}" for p in problems))


def _line_of(text: str, loc: tuple) -> int | None:
    """Best-effort TOML line of a field path: its table header, then the key inside that table."""
    keys = [str(k) for k in loc if not isinstance(k, int)]
    if not keys:
        return None
    lines = text.splitlines()
    table, key = keys[:-1], keys[-1]
    start = 0
    if table:
        header = re.compile(r"^\s*\[\s*" + r"\s*\.\s*".join(map(re.escape, table)) + r"\s*\]\s*(#.*)?$")
        hits = [i for i, ln in enumerate(lines) if header.match(ln)]
        if not hits:
            parent = _line_of(text, tuple(table))
            return parent
        start = hits[0] + 1
    key_re = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for i in range(start, len(lines)):
        if i > start and re.match(r"^\s*\[", lines[i]) and table:
            break
        if re.match(r"^\s*\[", lines[i]) and not table:
            break
        if key_re.match(lines[i]):
            return i + 1
    if table:
        return start  # the table header line
    hdr = re.compile(r"^\s*\[\s*" + re.escape(key) + r"\s*\]")
    return next((i + 1 for i, ln in enumerate(lines) if hdr.match(ln)), None)


def load_spec(path: str | Path) -> Spec:
    """Parse and validate a spec file; raise SpecError listing every problem found."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(str(path), [SpecProblem(path="<file>", message=str(e))]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise SpecError(str(path), [SpecProblem(path="<toml>", message=str(e), line=int(m.group(1)) if m else None)]) from None
    try:
        spec = Spec.model_validate(data, context={"base_dir": str(path.resolve().parent)})
        spec._source = data
        return spec
    except ValidationError as e:
        problems = []
        errors = []
        for err in e.errors():  # a cross-field problem names its field; harness settings errors, each theirs
            ctx = err.get("ctx") or {}
            if err["type"] == "spec_field":
                errors.append(err | {"loc": tuple(ctx["field"].split("."))})
            elif isinstance(ctx.get("error"), SettingsInvalid):
                errors += [x | {"loc": ("harness", "settings", *x["loc"])} for x in ctx["error"].error.errors()]
            else:
                errors.append(err)
        for err in errors:
            loc = tuple(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            elif err["type"] == "missing":
                msg = "field required"
            problems.append(SpecProblem(path=".".join(map(str, loc)) or "<root>", message=msg, line=_line_of(text, loc)))
        raise SpecError(str(path), problems) from None
