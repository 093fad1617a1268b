"""Harness fleet: the ECS cluster (Fargate) and the harness task definition (harness + local proxy shim)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.common import (
    child,
    ecr_pull_statements,
    logs_statements,
    role_with_policy,
    run_data_statements,
    statement,
    tags,
)

SHIM_PORT = 8080


@dataclass(frozen=True)
class HarnessFleetArgs:
    prefix: str
    bucket_arn: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    valkey_arn: pulumi.Input[str]
    valkey_endpoint: pulumi.Input[str]
    gateway_url: pulumi.Input[str]
    harness_repo_url: pulumi.Input[str]
    platform_repo_url: pulumi.Input[str]
    pull_repo_arns: list[pulumi.Input[str]]
    queue_prefix: str
    harness_image_tag: str
    shim_image_tag: str
    cpu: int = 1024
    memory: int = 4096
    ephemeral_gb: int = 30
    log_retention_days: int = 30


class HarnessFleet(pulumi.ComponentResource):
    def __init__(self, name: str, args: HarnessFleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:harness:HarnessFleet", name, None, opts)
        p = args.prefix
        t = tags(p, "harness")

        self.cluster = aws.ecs.Cluster(
            f"{name}-cluster",
            name=f"{p}-harness",
            settings=[{"name": "containerInsights", "value": "enabled"}],
            tags=t,
            opts=child(self),
        )
        aws.ecs.ClusterCapacityProviders(
            f"{name}-capacity",
            cluster_name=self.cluster.name,
            capacity_providers=["FARGATE", "FARGATE_SPOT"],
            default_capacity_provider_strategies=[{"capacity_provider": "FARGATE", "weight": 1, "base": 0}],
            opts=child(self),
        )
        self.log_group = aws.cloudwatch.LogGroup(
            f"{name}-logs", name=f"/{p}/harness", retention_in_days=args.log_retention_days, tags=t, opts=child(self)
        )
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "harness-exec",
            [*ecr_pull_statements(args.pull_repo_arns), *logs_statements([self.log_group.arn])],
            t,
        )
        self.task_role = role_with_policy(
            self,
            f"{name}-task-role",
            "ecs-tasks.amazonaws.com",
            "harness-task",
            [
                *run_data_statements(args.bucket_arn, args.key_arn, args.queue_prefix),
                statement(["elasticache:Connect"], [args.valkey_arn]),
            ],
            t,
        )
        rgn = aws.get_region_output().region
        containers = pulumi.Output.all(
            args.harness_repo_url, args.platform_repo_url, self.log_group.name, rgn, args.gateway_url, args.valkey_endpoint
        ).apply(
            lambda a: json.dumps(
                [
                    {
                        "name": "shim",
                        "image": f"{a[1]}:{args.shim_image_tag}",
                        "essential": True,
                        "memoryReservation": 256,
                        "environment": [
                            {"name": "SHIM_LISTEN", "value": f"127.0.0.1:{SHIM_PORT}"},
                            {"name": "GATEWAY_URL", "value": a[4]},
                            {"name": "VALKEY_URL", "value": f"rediss://{a[5]}:6379/0"},
                        ],
                        "healthCheck": {
                            "command": ["CMD-SHELL", f"wget -qO- http://127.0.0.1:{SHIM_PORT}/healthz || exit 1"],
                            "interval": 10,
                            "retries": 3,
                            "startPeriod": 10,
                        },
                        "logConfiguration": _logs(a[2], a[3], "shim"),
                    },
                    {
                        "name": "harness",
                        "image": f"{a[0]}:{args.harness_image_tag}",
                        "essential": True,
                        "dependsOn": [{"containerName": "shim", "condition": "HEALTHY"}],
                        "environment": [
                            {"name": "OPENAI_BASE_URL", "value": f"http://127.0.0.1:{SHIM_PORT}/v1"},
                            {"name": "ANTHROPIC_BASE_URL", "value": f"http://127.0.0.1:{SHIM_PORT}"},
                        ],
                        "logConfiguration": _logs(a[2], a[3], "harness"),
                    },
                ]
            )
        )
        self.task_definition = aws.ecs.TaskDefinition(
            f"{name}-task",
            family=f"{p}-harness",
            requires_compatibilities=["FARGATE"],
            network_mode="awsvpc",
            cpu=str(args.cpu),
            memory=str(args.memory),
            ephemeral_storage={"size_in_gib": args.ephemeral_gb},
            execution_role_arn=self.execution_role.arn,
            task_role_arn=self.task_role.arn,
            container_definitions=containers,
            runtime_platform={"operating_system_family": "LINUX", "cpu_architecture": "X86_64"},
            tags=t,
            opts=child(self),
        )
        self.cluster_arn = self.cluster.arn
        self.task_definition_arn = self.task_definition.arn
        self.register_outputs({"clusterArn": self.cluster_arn, "taskDefinitionArn": self.task_definition_arn})


def _logs(group: str, region: str, stream: str) -> dict:
    return {
        "logDriver": "awslogs",
        "options": {"awslogs-group": group, "awslogs-region": region, "awslogs-stream-prefix": stream},
    }
