"""Typed stack configuration (namespace "evalplane") and the address-space arithmetic."""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
from typing import Any

import pulumi
from pulumi.runtime import config as runtime_config
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAMESPACE = "evalplane"
AWS_RESERVED_PER_SUBNET = 5  # AWS keeps the first four and the last address of every subnet

# Tiers carved out of the primary VPC CIDR, with their prefix lengths (largest first when carved).
TIER_PREFIX = {
    "eval": 21,
    "gateway": 22,
    "build": 22,
    "endpoints": 24,
    "head": 24,
    "data": 24,
    "public": 24,
}


def key(alias: str, default: Any) -> Any:
    """A field whose stack config key is `evalplane:<alias>` (the keys' names are the camelCase of docs/infra.md)."""
    return Field(default, alias=alias)


class EstateConfig(BaseModel):
    """Every knob of the estate. Defaults are the production shape; see docs/infra.md.

    Built in Python by field name (`EstateConfig(az_count=4)`) or from the stack config by key
    (`from_pulumi_config()`, `evalplane:azCount`). Unknown keys are errors (extra="forbid"); values are
    converted in pydantic's lax mode ("3" -> 3, "true" -> True; lists may be JSON strings).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)

    prefix: str = key("prefix", "evalplane")
    az_count: int = key("azCount", 3)
    vpc_cidr: str = key("vpcCidr", "10.40.0.0/16")
    harness_cidr: str = key("harnessCidr", "10.41.0.0/16")
    target_tasks: int = key("targetTasks", 20_000)
    headroom: float = key("headroom", 1.5)
    nat_per_az: bool = key("natPerAz", False)
    extra_endpoints: tuple[str, ...] = key("extraEndpoints", ("ecs", "ecs-agent", "ecs-telemetry"))
    # state
    aurora_engine_version: str = key("auroraEngineVersion", "16.6")
    aurora_min_acu: float = key("auroraMinAcu", 0.0)
    aurora_max_acu: float = key("auroraMaxAcu", 16.0)
    valkey_node_type: str = key("valkeyNodeType", "cache.t4g.small")
    valkey_engine_version: str = key("valkeyEngineVersion", "8.0")
    protect_data: bool = key("protectData", True)
    log_retention_days: int = key("logRetentionDays", 30)
    log_expiry_days: int = key("logExpiryDays", 90)
    trajectory_ia_days: int = key("trajectoryIaDays", 30)
    trajectory_expiry_days: int = key("trajectoryExpiryDays", 365)
    # images
    # the gateway's replicas run LiteLLM with this project's gateway/ plugin code, so theirs is a platform image
    gateway_image_tag: str = key("gatewayImageTag", "gateway-latest")
    eval_worker_image_tag: str = key("evalWorkerImageTag", "eval-worker-latest")
    judge_image_tag: str = key("judgeImageTag", "judge-latest")
    package_index_image_tag: str = key("packageIndexImageTag", "package-index-latest")
    # gateway
    gateway_replicas: int = key("gatewayReplicas", 2)
    gateway_cpu: int = key("gatewayCpu", 1024)
    gateway_memory: int = key("gatewayMemory", 2048)
    gateway_providers: tuple[str, ...] = key("gatewayProviders", ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"))
    # harness / judge (Fargate)
    harness_cpu: int = key("harnessCpu", 1024)
    harness_memory: int = key("harnessMemory", 4096)
    harness_ephemeral_gb: int = key("harnessEphemeralGb", 30)
    judge_cpu: int = key("judgeCpu", 512)
    judge_memory: int = key("judgeMemory", 1024)
    queue_prefix: str = key("queuePrefix", "evalplane-")
    # eval fleet (ECS on EC2)
    eval_instance_type: str = key("evalInstanceType", "m6i.2xlarge")
    eval_max_instances: int = key("evalMaxInstances", 50)
    eval_disk_gb: int = key("evalDiskGb", 500)
    eval_worker_cpu: int = key("evalWorkerCpu", 2048)
    eval_worker_memory: int = key("evalWorkerMemory", 7168)
    # the package index the grading containers' pip reaches (proxpi on Fargate in the build subnets)
    package_index_replicas: int = key("packageIndexReplicas", 1)
    package_index_upstream: str = key("packageIndexUpstream", "")  # "" = proxpi's default upstream (PyPI's simple API)
    # head node and build tier
    head_instance_type: str = key("headInstanceType", "m6i.large")
    head_disk_gb: int = key("headDiskGb", 100)
    build_instance_type: str = key("buildInstanceType", "m6i.2xlarge")
    build_max_instances: int = key("buildMaxInstances", 4)
    build_disk_gb: int = key("buildDiskGb", 1000)
    task_image_expiry_days: int = key("taskImageExpiryDays", 90)
    # guard and budget
    guard_schedule: str = key("guardSchedule", "cron(0 2 * * ? *)")
    guard_timezone: str = key("guardTimezone", "UTC")
    deadline_schedule: str = key("deadlineSchedule", "rate(15 minutes)")
    guard_enabled: bool = key("guardEnabled", True)
    monthly_budget_usd: float = key("monthlyBudgetUsd", 1000.0)
    budget_emails: tuple[str, ...] = key("budgetEmails", ())

    @field_validator("extra_endpoints", "gateway_providers", "budget_emails", mode="before")
    @classmethod
    def _json_list(cls, v: Any) -> Any:
        """Pulumi hands a list-valued key (`pulumi config set --path 'evalplane:budgetEmails[0]' ...`) over as JSON."""
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"expected a JSON list of strings, got {v!r}") from e
        return v  # anything but a list of strings fails the tuple's own validation

    @field_validator("gateway_providers")
    @classmethod
    def _provider_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        """Each is a secret's name (under <prefix>/gateway/provider-keys/) and a spec's model.api_key_env."""
        bad = [n for n in v if not re.fullmatch(r"[A-Za-z0-9_]+", n)]
        if bad:
            raise ValueError(f"gatewayProviders: names are letters, digits and underscores, not {bad}")
        return v

    @field_validator("az_count")
    @classmethod
    def _az_count(cls, v: int) -> int:
        if not 2 <= v <= 6:
            raise ValueError("azCount must be between 2 and 6")
        return v

    @field_validator("headroom")
    @classmethod
    def _headroom(cls, v: float) -> float:
        if v < 1.0:
            raise ValueError("headroom must be >= 1.0")
        return v

    @field_validator("harness_ephemeral_gb")
    @classmethod
    def _harness_ephemeral_gb(cls, v: int) -> int:
        if not 21 <= v <= 200:  # Fargate's range; the task image is pulled into it
            raise ValueError("harnessEphemeralGb must be between 21 and 200 (Fargate)")
        return v

    @field_validator("task_image_expiry_days")
    @classmethod
    def _task_image_expiry_days(cls, v: int) -> int:
        if v < 1:
            raise ValueError("taskImageExpiryDays must be >= 1")
        return v

    @field_validator("package_index_replicas")
    @classmethod
    def _package_index_replicas(cls, v: int) -> int:
        if v < 0:
            raise ValueError("packageIndexReplicas must be >= 0")
        return v

    @field_validator("package_index_upstream")
    @classmethod
    def _package_index_upstream(cls, v: str) -> str:
        if v and not v.startswith("https://"):
            # the index's tasks may open HTTPS only (components/security.py)
            raise ValueError("packageIndexUpstream must be an https:// simple-API URL")
        return v

    @model_validator(mode="after")
    def _aurora_range(self) -> EstateConfig:
        if self.aurora_max_acu < self.aurora_min_acu:
            raise ValueError("auroraMaxAcu must be >= auroraMinAcu")
        return self


# Every key of the "evalplane" namespace, as written in Pulumi.<stack>.yaml (docs/infra.md "Stack config").
CONFIG_KEYS: tuple[str, ...] = tuple(f.alias or n for n, f in EstateConfig.model_fields.items())
_STR_KEYS = frozenset(f.alias for f in EstateConfig.model_fields.values() if f.annotation in (str, "str"))


class ConfigError(ValueError):
    """The stack config does not validate; the message names every offending `evalplane:<key>`."""


def namespace_config(namespace: str = NAMESPACE) -> dict[str, Any]:
    """Every key set in `namespace` (without the "<namespace>:" prefix), with its raw value.

    pulumi.Config has no way to list keys, so the keys come from where pulumi.runtime.config.get_config looks:
    the config map (set by the engine's automation server or `pulumi.runtime.set_all_config`) and the
    PULUMI_CONFIG JSON bag the language host passes; PULUMI_CONFIG_<KEY> variables cannot be mapped back to a
    key, so they are read for the known keys only. Values are read through pulumi.Config (same precedence).
    """
    prefix = f"{namespace}:"
    present = {*runtime_config.CONFIG.get(), *runtime_config.get_config_env()}
    keys = {k[len(prefix):] for k in present if k.startswith(prefix)}
    keys |= {k for k in CONFIG_KEYS if runtime_config.get_config_env_key(prefix + k) in os.environ}
    c = pulumi.Config(namespace)
    return {k: v for k in sorted(keys) if (v := c.get(k)) is not None}


def _describe(err: dict[str, Any], secret_keys: frozenset[str]) -> str:
    loc = [str(p) for p in err["loc"]]
    where = f"{NAMESPACE}:{loc[0]}" if loc else NAMESPACE
    if len(loc) > 1:
        where += f" (item {'.'.join(loc[1:])})"
    if err["type"] == "extra_forbidden":
        near = difflib.get_close_matches(loc[0], CONFIG_KEYS, n=1)
        hint = f"; did you mean {NAMESPACE}:{near[0]}?" if near else ""
        return f"{where}: not a config key of this program{hint} (the keys: docs/infra.md, Stack config)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] != "value_error" and loc and loc[0] not in secret_keys:
        msg += f" (got {err['input']!r})"
    return f"{where}: {msg}"


def config_from_mapping(values: dict[str, Any], secret_keys: frozenset[str] = frozenset()) -> EstateConfig:
    """Validate stack config keys (camelCase, without the namespace) into an EstateConfig, or raise ConfigError
    naming each key that is unknown or whose value does not validate (a secret key's value is never echoed)."""
    # an empty string value of a string key means the default, as `pulumi.Config.get(k) or default` did
    values = {k: v for k, v in values.items() if not (k in _STR_KEYS and v == "")}
    try:
        return EstateConfig.model_validate(values, by_alias=True, by_name=False)
    except ValidationError as e:
        problems = [_describe(err, secret_keys) for err in e.errors(include_url=False)]
        raise ConfigError(f"invalid stack config (namespace {NAMESPACE}):\n  " + "\n  ".join(problems)) from None


def from_pulumi_config() -> EstateConfig:
    """Read the whole "evalplane" config namespace and validate it; every key is optional (defaults above), and a
    key EstateConfig does not know, or a value of the wrong type, is an error naming the key."""
    values = namespace_config(NAMESPACE)
    env_secrets = set(runtime_config.get_config_secret_keys_env())  # the language host's list (`pulumi up`)
    secret = frozenset(
        k for k in values if runtime_config.is_config_secret(f"{NAMESPACE}:{k}") or f"{NAMESPACE}:{k}" in env_secrets
    )
    return config_from_mapping(values, secret)


# ------------------------------------------------------------------ address-space arithmetic


def usable(prefixlen: int) -> int:
    """Addresses an ENI can take in an IPv4 subnet of this size."""
    return 2 ** (32 - prefixlen) - AWS_RESERVED_PER_SUBNET


def harness_prefixlen(target_tasks: int, headroom: float, az_count: int) -> int:
    """The smallest subnet (largest prefix length) that holds one AZ's share of the task ENIs.

    One Fargate task = one ENI = one address. 20,000 tasks x 1.5 headroom over 3 AZs is 10,000 per AZ:
    a /19 holds 8,187, a /18 holds 16,379, so each harness subnet is a /18.
    """
    per_az = math.ceil(target_tasks * headroom / az_count)
    for plen in range(28, 15, -1):  # AWS subnets are /16 .. /28
        if usable(plen) >= per_az:
            return plen
    raise ValueError(f"{per_az} ENIs per AZ do not fit in one subnet (max /16); raise azCount")


def harness_subnets(cfg: EstateConfig) -> list[str]:
    plen = harness_prefixlen(cfg.target_tasks, cfg.headroom, cfg.az_count)
    block = ipaddress.ip_network(cfg.harness_cidr)
    if plen < block.prefixlen:
        raise ValueError(f"harnessCidr {block} cannot hold a /{plen} subnet")
    nets = list(block.subnets(new_prefix=plen))
    if len(nets) < cfg.az_count:
        raise ValueError(f"harnessCidr {block} holds {len(nets)} /{plen} subnets, need {cfg.az_count}")
    return [str(n) for n in nets[: cfg.az_count]]


def harness_capacity(cidrs: list[str]) -> int:
    """Task ENIs the given harness subnets can hold."""
    return sum(usable(ipaddress.ip_network(c).prefixlen) for c in cidrs)


def tier_subnets(cfg: EstateConfig) -> dict[str, list[str]]:
    """Carve every non-harness tier out of vpcCidr, one subnet per AZ, largest blocks first (aligned)."""
    block = ipaddress.ip_network(cfg.vpc_cidr)
    if not 16 <= block.prefixlen <= 28:
        raise ValueError("vpcCidr must be between /16 and /28 (AWS limit)")
    cursor = int(block.network_address)
    end = int(block.broadcast_address) + 1
    out: dict[str, list[str]] = {}
    for tier, plen in sorted(TIER_PREFIX.items(), key=lambda kv: kv[1]):
        size = 2 ** (32 - plen)
        out[tier] = []
        for _ in range(cfg.az_count):
            cursor = (cursor + size - 1) // size * size  # align
            if cursor + size > end:
                raise ValueError(f"vpcCidr {block} is too small for the {tier} tier x {cfg.az_count} AZs")
            out[tier].append(str(ipaddress.ip_network((cursor, plen))))
            cursor += size
    return out
