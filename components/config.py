"""Typed stack configuration (namespace "evalplane") and the address-space arithmetic."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field

import pulumi

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


@dataclass(frozen=True)
class EstateConfig:
    """Every knob of the estate. Defaults are the production shape; see docs/infra.md."""

    prefix: str = "evalplane"
    az_count: int = 3
    vpc_cidr: str = "10.40.0.0/16"
    harness_cidr: str = "10.41.0.0/16"
    target_tasks: int = 20_000
    headroom: float = 1.5
    nat_per_az: bool = False
    extra_endpoints: tuple[str, ...] = ("ecs", "ecs-agent", "ecs-telemetry")
    # state
    aurora_engine_version: str = "16.6"
    aurora_min_acu: float = 0.0
    aurora_max_acu: float = 16.0
    valkey_node_type: str = "cache.t4g.small"
    valkey_engine_version: str = "8.0"
    protect_data: bool = True
    log_retention_days: int = 30
    log_expiry_days: int = 90
    trajectory_ia_days: int = 30
    trajectory_expiry_days: int = 365
    # images
    litellm_image: str = "ghcr.io/berriai/litellm"
    litellm_image_tag: str = "main-stable"
    eval_worker_image_tag: str = "eval-worker-latest"
    judge_image_tag: str = "judge-latest"
    package_index_image_tag: str = "package-index-latest"
    # gateway
    gateway_replicas: int = 2
    gateway_cpu: int = 1024
    gateway_memory: int = 2048
    gateway_providers: tuple[str, ...] = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY")
    # harness / judge (Fargate)
    harness_cpu: int = 1024
    harness_memory: int = 4096
    harness_ephemeral_gb: int = 30
    judge_cpu: int = 512
    judge_memory: int = 1024
    queue_prefix: str = "evalplane-"
    # eval fleet (ECS on EC2)
    eval_instance_type: str = "m6i.2xlarge"
    eval_max_instances: int = 50
    eval_disk_gb: int = 500
    eval_worker_cpu: int = 2048
    eval_worker_memory: int = 7168
    # the package index the grading containers' pip reaches (proxpi on Fargate in the build subnets)
    package_index_replicas: int = 1
    package_index_upstream: str = ""  # "" = proxpi's default upstream (PyPI's simple API)
    # head node and build tier
    head_instance_type: str = "m6i.large"
    head_disk_gb: int = 100
    build_instance_type: str = "m6i.2xlarge"
    build_max_instances: int = 4
    build_disk_gb: int = 1000
    task_image_expiry_days: int = 90
    # guard and budget
    guard_schedule: str = "cron(0 2 * * ? *)"
    guard_timezone: str = "UTC"
    deadline_schedule: str = "rate(15 minutes)"
    guard_enabled: bool = True
    monthly_budget_usd: float = 1000.0
    budget_emails: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not 2 <= self.az_count <= 6:
            raise ValueError("azCount must be between 2 and 6")
        if self.headroom < 1.0:
            raise ValueError("headroom must be >= 1.0")
        if self.aurora_max_acu < self.aurora_min_acu:
            raise ValueError("auroraMaxAcu must be >= auroraMinAcu")
        if not 21 <= self.harness_ephemeral_gb <= 200:  # Fargate's range; the task image is pulled into it
            raise ValueError("harnessEphemeralGb must be between 21 and 200 (Fargate)")
        if self.task_image_expiry_days < 1:
            raise ValueError("taskImageExpiryDays must be >= 1")
        if self.package_index_replicas < 0:
            raise ValueError("packageIndexReplicas must be >= 0")
        if self.package_index_upstream and not self.package_index_upstream.startswith("https://"):
            # the index's tasks may open HTTPS only (components/security.py)
            raise ValueError("packageIndexUpstream must be an https:// simple-API URL")


def from_pulumi_config() -> EstateConfig:
    """Read the "evalplane" config namespace; every key is optional (defaults above)."""
    c = pulumi.Config(NAMESPACE)
    d = EstateConfig()

    def s(key: str, default: str) -> str:
        return c.get(key) or default

    def i(key: str, default: int) -> int:
        v = c.get_int(key)
        return default if v is None else v

    def f(key: str, default: float) -> float:
        v = c.get_float(key)
        return default if v is None else v

    def b(key: str, default: bool) -> bool:
        v = c.get_bool(key)
        return default if v is None else v

    def lst(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        v = c.get_object(key)
        return default if v is None else tuple(str(x) for x in v)

    return EstateConfig(
        prefix=s("prefix", d.prefix),
        az_count=i("azCount", d.az_count),
        vpc_cidr=s("vpcCidr", d.vpc_cidr),
        harness_cidr=s("harnessCidr", d.harness_cidr),
        target_tasks=i("targetTasks", d.target_tasks),
        headroom=f("headroom", d.headroom),
        nat_per_az=b("natPerAz", d.nat_per_az),
        extra_endpoints=lst("extraEndpoints", d.extra_endpoints),
        aurora_engine_version=s("auroraEngineVersion", d.aurora_engine_version),
        aurora_min_acu=f("auroraMinAcu", d.aurora_min_acu),
        aurora_max_acu=f("auroraMaxAcu", d.aurora_max_acu),
        valkey_node_type=s("valkeyNodeType", d.valkey_node_type),
        valkey_engine_version=s("valkeyEngineVersion", d.valkey_engine_version),
        protect_data=b("protectData", d.protect_data),
        log_retention_days=i("logRetentionDays", d.log_retention_days),
        log_expiry_days=i("logExpiryDays", d.log_expiry_days),
        trajectory_ia_days=i("trajectoryIaDays", d.trajectory_ia_days),
        trajectory_expiry_days=i("trajectoryExpiryDays", d.trajectory_expiry_days),
        litellm_image=s("litellmImage", d.litellm_image),
        litellm_image_tag=s("litellmImageTag", d.litellm_image_tag),
        eval_worker_image_tag=s("evalWorkerImageTag", d.eval_worker_image_tag),
        judge_image_tag=s("judgeImageTag", d.judge_image_tag),
        package_index_image_tag=s("packageIndexImageTag", d.package_index_image_tag),
        gateway_replicas=i("gatewayReplicas", d.gateway_replicas),
        gateway_cpu=i("gatewayCpu", d.gateway_cpu),
        gateway_memory=i("gatewayMemory", d.gateway_memory),
        gateway_providers=lst("gatewayProviders", d.gateway_providers),
        harness_cpu=i("harnessCpu", d.harness_cpu),
        harness_memory=i("harnessMemory", d.harness_memory),
        harness_ephemeral_gb=i("harnessEphemeralGb", d.harness_ephemeral_gb),
        judge_cpu=i("judgeCpu", d.judge_cpu),
        judge_memory=i("judgeMemory", d.judge_memory),
        queue_prefix=s("queuePrefix", d.queue_prefix),
        eval_instance_type=s("evalInstanceType", d.eval_instance_type),
        eval_max_instances=i("evalMaxInstances", d.eval_max_instances),
        eval_disk_gb=i("evalDiskGb", d.eval_disk_gb),
        eval_worker_cpu=i("evalWorkerCpu", d.eval_worker_cpu),
        eval_worker_memory=i("evalWorkerMemory", d.eval_worker_memory),
        package_index_replicas=i("packageIndexReplicas", d.package_index_replicas),
        package_index_upstream=s("packageIndexUpstream", d.package_index_upstream),
        head_instance_type=s("headInstanceType", d.head_instance_type),
        head_disk_gb=i("headDiskGb", d.head_disk_gb),
        build_instance_type=s("buildInstanceType", d.build_instance_type),
        build_max_instances=i("buildMaxInstances", d.build_max_instances),
        build_disk_gb=i("buildDiskGb", d.build_disk_gb),
        task_image_expiry_days=i("taskImageExpiryDays", d.task_image_expiry_days),
        guard_schedule=s("guardSchedule", d.guard_schedule),
        guard_timezone=s("guardTimezone", d.guard_timezone),
        deadline_schedule=s("deadlineSchedule", d.deadline_schedule),
        guard_enabled=b("guardEnabled", d.guard_enabled),
        monthly_budget_usd=f("monthlyBudgetUsd", d.monthly_budget_usd),
        budget_emails=lst("budgetEmails", d.budget_emails),
    )


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
