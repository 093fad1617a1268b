"""The blocks every compute tier repeats, as functions that declare children of the calling component.

- ECS: `ecs_cluster` (Container Insights on), `log_group` (`/<prefix>/<tier>`), `awslogs` (a container's
  logConfiguration), `task_definition` (Fargate or EC2, from `TaskDefinitionArgs`);
- `fargate_service`: an ECS service of Fargate tasks behind an internal Application Load Balancer (load balancer,
  target group, listener, optional listener rule, service), from `FargateServiceArgs`;
- `autoscaling_tier`: EC2 hosts in an Auto Scaling group that starts at zero (instance profile, hardened launch
  template, group, and for an ECS tier its capacity provider on the cluster), from `AutoscalingTierArgs`.

Every resource is a child of `parent` (the component), named `<name>-<suffix>` as the components always named
them, so URNs do not move; none is declared inside an `apply`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pulumi
import pulumi_aws as aws

from components.common import child
from components.ec2 import instance_profile, launch_template

X86_LINUX = {"operating_system_family": "LINUX", "cpu_architecture": "X86_64"}


# ------------------------------------------------------------------------------------------------ ECS
def ecs_cluster(parent: pulumi.Resource, name: str, cluster_name: str, tier_tags: dict[str, str]) -> aws.ecs.Cluster:
    """`<name>-cluster`, physically `cluster_name`, with Container Insights."""
    return aws.ecs.Cluster(
        f"{name}-cluster",
        name=cluster_name,
        settings=[{"name": "containerInsights", "value": "enabled"}],
        tags=tier_tags,
        opts=child(parent),
    )


def log_group(
    parent: pulumi.Resource, name: str, path: str, retention_days: int, tier_tags: dict[str, str]
) -> aws.cloudwatch.LogGroup:
    """`<name>-logs`: the tier's CloudWatch log group (`path`, e.g. /evalplane/gateway)."""
    return aws.cloudwatch.LogGroup(
        f"{name}-logs", name=path, retention_in_days=retention_days, tags=tier_tags, opts=child(parent)
    )


def awslogs(group: str, region_name: str, stream_prefix: str) -> dict[str, Any]:
    """A container definition's logConfiguration: the awslogs driver into `group` (plain values: call it in the
    apply that renders the container definitions)."""
    return {
        "logDriver": "awslogs",
        "options": {"awslogs-group": group, "awslogs-region": region_name, "awslogs-stream-prefix": stream_prefix},
    }


@dataclass(frozen=True)
class TaskDefinitionArgs:
    family: str
    cpu: int
    memory: int
    execution_role_arn: pulumi.Input[str]
    container_definitions: pulumi.Input[str]  # JSON, usually rendered in an apply over the log group and images
    task_role_arn: pulumi.Input[str] | None = None  # None: the tasks get no AWS credentials at all
    launch: Literal["FARGATE", "EC2"] = "FARGATE"  # FARGATE: awsvpc networking; EC2: bridge on the host
    ephemeral_gb: int | None = None  # Fargate task storage beyond the default
    volumes: list[dict[str, Any]] = field(default_factory=list)
    x86_linux: bool = False  # pin the runtime platform (LINUX / X86_64)


def task_definition(
    parent: pulumi.Resource, name: str, args: TaskDefinitionArgs, tier_tags: dict[str, str]
) -> aws.ecs.TaskDefinition:
    """`<name>-task`."""
    extra: dict[str, Any] = {}
    if args.task_role_arn is not None:
        extra["task_role_arn"] = args.task_role_arn
    if args.ephemeral_gb is not None:
        extra["ephemeral_storage"] = {"size_in_gib": args.ephemeral_gb}
    if args.volumes:
        extra["volumes"] = args.volumes
    if args.x86_linux:
        extra["runtime_platform"] = X86_LINUX
    return aws.ecs.TaskDefinition(
        f"{name}-task",
        family=args.family,
        requires_compatibilities=[args.launch],
        network_mode="awsvpc" if args.launch == "FARGATE" else "bridge",
        cpu=str(args.cpu),
        memory=str(args.memory),
        execution_role_arn=args.execution_role_arn,
        container_definitions=args.container_definitions,
        **extra,
        tags=tier_tags,
        opts=child(parent),
    )


# ------------------------------------------------------------------------------- Fargate behind an ALB
@dataclass(frozen=True)
class ListenerRoute:
    """Forward only these requests (one listener rule); every other request gets a fixed 404."""

    suffix: str  # the rule is `<name>-<suffix>`
    path_pattern: str
    methods: list[str]
    not_found_body: str
    priority: int = 10


@dataclass(frozen=True)
class FargateServiceArgs:
    service_name: str
    cluster_arn: pulumi.Input[str]
    task_definition_arn: pulumi.Input[str]
    container: str  # the container the target group sends to
    container_port: int
    listener_port: int
    replicas: int
    subnet_ids: list[pulumi.Input[str]]  # of the tasks and of the load balancer
    lb_sg_id: pulumi.Input[str]
    task_sg_id: pulumi.Input[str]
    vpc_id: pulumi.Input[str]
    health_check_path: str
    idle_timeout: int
    min_healthy_percent: int
    route: ListenerRoute | None = None  # None: the listener forwards every request


@dataclass(frozen=True)
class FargateService:
    lb: aws.lb.LoadBalancer
    target_group: aws.lb.TargetGroup
    listener: aws.lb.Listener
    rules: list[aws.lb.ListenerRule]
    service: aws.ecs.Service


def fargate_service(
    parent: pulumi.Resource, name: str, args: FargateServiceArgs, tier_tags: dict[str, str]
) -> FargateService:
    """`<name>-alb` (internal, invalid headers dropped), `<name>-tg` (ip targets), `<name>-listener` (HTTP),
    `<name>-<route.suffix>` when routed, and `<name>-service`: Fargate tasks without public IPs, rolling
    deployments with the circuit breaker's rollback, created after the listener (and its rule)."""
    lb = aws.lb.LoadBalancer(
        f"{name}-alb",
        internal=True,
        load_balancer_type="application",
        subnets=args.subnet_ids,
        security_groups=[args.lb_sg_id],
        drop_invalid_header_fields=True,
        idle_timeout=args.idle_timeout,
        tags=tier_tags,
        opts=child(parent),
    )
    target_group = aws.lb.TargetGroup(
        f"{name}-tg",
        port=args.container_port,
        protocol="HTTP",
        target_type="ip",
        vpc_id=args.vpc_id,
        deregistration_delay=60,
        health_check={"path": args.health_check_path, "matcher": "200", "interval": 15},
        tags=tier_tags,
        opts=child(parent),
    )
    forward = {"type": "forward", "target_group_arn": target_group.arn}
    route = args.route
    default_action = forward if route is None else {
        "type": "fixed-response",
        "fixed_response": {"content_type": "text/plain", "status_code": "404", "message_body": route.not_found_body},
    }
    listener = aws.lb.Listener(
        f"{name}-listener",
        load_balancer_arn=lb.arn,
        port=args.listener_port,
        protocol="HTTP",
        default_actions=[default_action],
        opts=child(parent),
    )
    rules = []
    if route is not None:
        rules.append(
            aws.lb.ListenerRule(
                f"{name}-{route.suffix}",
                listener_arn=listener.arn,
                priority=route.priority,
                conditions=[
                    {"path_pattern": {"values": [route.path_pattern]}},
                    {"http_request_method": {"values": route.methods}},
                ],
                actions=[forward],
                tags=tier_tags,
                opts=child(parent),
            )
        )
    service = aws.ecs.Service(
        f"{name}-service",
        name=args.service_name,
        cluster=args.cluster_arn,
        task_definition=args.task_definition_arn,
        desired_count=args.replicas,
        launch_type="FARGATE",
        network_configuration={
            "subnets": args.subnet_ids,
            "security_groups": [args.task_sg_id],
            "assign_public_ip": False,
        },
        load_balancers=[
            {"target_group_arn": target_group.arn, "container_name": args.container,
             "container_port": args.container_port}
        ],
        deployment_minimum_healthy_percent=args.min_healthy_percent,
        deployment_maximum_percent=200,
        deployment_circuit_breaker={"enable": True, "rollback": True},
        tags=tier_tags,
        opts=child(parent, depends_on=[listener, *rules]),
    )
    return FargateService(lb, target_group, listener, rules, service)


# ------------------------------------------------------------------------------ EC2 Auto Scaling tiers
@dataclass(frozen=True)
class EcsCapacity:
    """Make the group an ECS capacity provider of `cluster` (managed scaling, the cluster's default strategy)."""

    cluster: aws.ecs.Cluster
    provider_name: str


@dataclass(frozen=True)
class AutoscalingTierArgs:
    asg_name: str
    role: aws.iam.Role  # the hosts' instance role (its profile is declared here)
    image_id: str
    instance_type: str
    max_instances: int
    disk_gb: int
    subnet_ids: list[pulumi.Input[str]]
    sg_id: pulumi.Input[str]
    script: pulumi.Input[str]  # user data
    profile_suffix: str = "profile"  # the instance profile is `<name>-<profile_suffix>`
    ecs: EcsCapacity | None = None


@dataclass(frozen=True)
class AutoscalingTier:
    launch_template: aws.ec2.LaunchTemplate
    asg: aws.autoscaling.Group
    capacity_provider: aws.ecs.CapacityProvider | None = None
    cluster_capacity: aws.ecs.ClusterCapacityProviders | None = None


def autoscaling_tier(
    parent: pulumi.Resource, name: str, args: AutoscalingTierArgs, tier_tags: dict[str, str]
) -> AutoscalingTier:
    """`<name>-<profile_suffix>`, `<name>-lt` (components/ec2.py: no public IP, IMDSv2 out of containers' reach,
    encrypted gp3), `<name>-asg` (minimum 0, desired capacity left to whoever scales it), and for an ECS tier
    `<name>-cp` and `<name>-capacity`. A plain tier's group starts at 0; an ECS tier's group is sized by its
    capacity provider (the `AmazonECSManaged` tag, no scale-in protection)."""
    profile = instance_profile(parent, f"{name}-{args.profile_suffix}", args.role)
    lt = launch_template(
        parent,
        f"{name}-lt",
        image_id=args.image_id,
        instance_type=args.instance_type,
        sg_ids=[args.sg_id],
        instance_profile_arn=profile.arn,
        disk_gb=args.disk_gb,
        script=args.script,
        tier_tags=tier_tags,
    )
    propagated = [{"key": k, "value": v, "propagate_at_launch": True} for k, v in tier_tags.items()]
    sizing: dict[str, Any] = (
        {"desired_capacity": 0, "tags": propagated}
        if args.ecs is None
        else {
            "protect_from_scale_in": False,
            "tags": [{"key": "AmazonECSManaged", "value": "true", "propagate_at_launch": True}, *propagated],
        }
    )
    asg = aws.autoscaling.Group(
        f"{name}-asg",
        name=args.asg_name,
        min_size=0,
        max_size=args.max_instances,
        vpc_zone_identifiers=args.subnet_ids,
        launch_template={"id": lt.id, "version": "$Latest"},
        **sizing,
        opts=child(parent, ignore_changes=["desiredCapacity"]),
    )
    if args.ecs is None:
        return AutoscalingTier(lt, asg)
    cp = aws.ecs.CapacityProvider(
        f"{name}-cp",
        name=args.ecs.provider_name,
        auto_scaling_group_provider={
            "auto_scaling_group_arn": asg.arn,
            "managed_termination_protection": "DISABLED",
            "managed_scaling": {"status": "ENABLED", "target_capacity": 100, "maximum_scaling_step_size": 10},
        },
        tags=tier_tags,
        opts=child(parent),
    )
    capacity = aws.ecs.ClusterCapacityProviders(
        f"{name}-capacity",
        cluster_name=args.ecs.cluster.name,
        capacity_providers=[cp.name],
        default_capacity_provider_strategies=[{"capacity_provider": cp.name, "weight": 1}],
        opts=child(parent),
    )
    return AutoscalingTier(lt, asg, cp, capacity)
