"""Eval fleet: ECS on EC2 (grading needs Docker on a real host), a capacity provider on an ASG (min 0)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.common import (
    account_id,
    child,
    ecr_pull_statements,
    logs_statements,
    region,
    role_with_policy,
    run_data_statements,
    statement,
    tags,
)
from components.ec2 import AL2023_ECS_AMI
from components.tiers import (
    AutoscalingTierArgs,
    EcsCapacity,
    TaskDefinitionArgs,
    autoscaling_tier,
    awslogs,
    ecs_cluster,
    log_group,
    task_definition,
)
from contract import signing
from eval_worker.package_index import PACKAGE_INDEX_ENV
from plumbing.egress import EGRESS_IMAGE_ENV


@dataclass(frozen=True)
class EvalFleetArgs:
    prefix: str
    subnet_ids: list[pulumi.Input[str]]
    sg_id: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    valkey_arn: pulumi.Input[str]
    verdict_key_arn: pulumi.Input[str]  # what workers sign verdicts with (an ECS secret of the worker container)
    eval_repo_arn: pulumi.Input[str]
    platform_repo_arn: pulumi.Input[str]
    platform_repo_url: pulumi.Input[str]
    queue_prefix: str
    worker_image_tag: str
    package_index_url: pulumi.Input[str]  # the simple-API base URL the grading containers' pip is relayed to
    instance_type: str = "m6i.2xlarge"
    max_instances: int = 50
    disk_gb: int = 500
    worker_cpu: int = 2048
    worker_memory: int = 7168
    log_retention_days: int = 30


class EvalFleet(pulumi.ComponentResource):
    def __init__(self, name: str, args: EvalFleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:eval:EvalFleet", name, None, opts)
        p = args.prefix
        t = tags(p, "eval")
        cluster_name = f"{p}-eval"

        self.cluster = ecs_cluster(self, name, cluster_name, t)
        container_instances = pulumi.Output.concat(
            "arn:aws:ecs:", region(), ":", account_id(), ":container-instance/", cluster_name, "/*"
        )
        instance_role = role_with_policy(
            self,
            f"{name}-instance-role",
            "ec2.amazonaws.com",
            "eval-instance",
            [
                statement(["ecs:DiscoverPollEndpoint"], "*", sid="EcsAgentDiscoverHasNoResource"),
                statement(
                    [
                        "ecs:DeregisterContainerInstance",
                        "ecs:RegisterContainerInstance",
                        "ecs:SubmitAttachmentStateChanges",
                        "ecs:SubmitContainerStateChange",
                        "ecs:SubmitTaskStateChange",
                    ],
                    [self.cluster.arn],
                ),
                statement(
                    ["ecs:Poll", "ecs:StartTelemetrySession", "ecs:UpdateContainerInstancesState", "ecs:TagResource"],
                    [container_instances],
                ),
                *ecr_pull_statements([args.platform_repo_arn, args.eval_repo_arn]),
            ],
            t,
        )
        script = (
            "#!/bin/bash\nset -euo pipefail\ncat >> /etc/ecs/ecs.config <<'EOF'\n"
            f"ECS_CLUSTER={cluster_name}\n"
            "ECS_ENABLE_TASK_IAM_ROLE=true\n"
            "ECS_IMAGE_PULL_BEHAVIOR=prefer-cached\n"
            "ECS_ENGINE_TASK_CLEANUP_WAIT_DURATION=10m\n"
            "ECS_IMAGE_MINIMUM_CLEANUP_AGE=2h\n"
            "EOF\n"
        )
        hosts = autoscaling_tier(
            self,
            name,
            AutoscalingTierArgs(
                asg_name=f"{p}-eval",
                role=instance_role,
                image_id=AL2023_ECS_AMI,
                instance_type=args.instance_type,
                max_instances=args.max_instances,
                disk_gb=args.disk_gb,
                subnet_ids=args.subnet_ids,
                sg_id=args.sg_id,
                script=script,
                profile_suffix="instance-profile",
                ecs=EcsCapacity(cluster=self.cluster, provider_name=f"{p}-eval-asg"),
            ),
            t,
        )
        self.launch_template, self.asg = hosts.launch_template, hosts.asg
        self.capacity_provider = hosts.capacity_provider

        self.log_group = log_group(self, name, f"/{p}/eval", args.log_retention_days, t)
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "eval-exec",
            [*ecr_pull_statements([args.platform_repo_arn]), *logs_statements([self.log_group.arn]),
             statement(["secretsmanager:GetSecretValue"], [args.verdict_key_arn]),
             statement(["kms:Decrypt"], [args.key_arn])],
            t,
        )
        self.task_role = role_with_policy(
            self,
            f"{name}-task-role",
            "ecs-tasks.amazonaws.com",
            "eval-task",
            [
                # eval queues in, verdict queues out (only this role may send there)
                *run_data_statements(args.bucket_arn, args.key_arn, args.queue_prefix, queues="eval"),
                *ecr_pull_statements([args.eval_repo_arn]),  # per-instance images, pulled via the host's Docker
                statement(["elasticache:Connect"], [args.valkey_arn]),
            ],
            t,
        )
        containers = pulumi.Output.all(
            args.platform_repo_url, self.log_group.name, region(), args.verdict_key_arn, args.package_index_url
        ).apply(
            lambda a: json.dumps(
                [
                    {
                        "name": "eval-worker",
                        "image": f"{a[0]}:{args.worker_image_tag}",
                        "essential": True,
                        "memory": args.worker_memory,
                        "mountPoints": [{"sourceVolume": "docker-sock", "containerPath": "/var/run/docker.sock"}],
                        # the grading network's egress runs a standard-library forwarder in the worker's own image
                        "environment": [{"name": PACKAGE_INDEX_ENV, "value": a[4]},
                                        {"name": EGRESS_IMAGE_ENV, "value": f"{a[0]}:{args.worker_image_tag}"}],
                        "secrets": [{"name": signing.VERDICT_KEY_ENV, "valueFrom": a[3]}],
                        "logConfiguration": awslogs(a[1], a[2], "eval"),
                    }
                ]
            )
        )
        self.task_definition = task_definition(
            self,
            name,
            TaskDefinitionArgs(
                family=f"{p}-eval-worker",
                cpu=args.worker_cpu,
                memory=args.worker_memory,
                execution_role_arn=self.execution_role.arn,
                task_role_arn=self.task_role.arn,
                container_definitions=containers,
                launch="EC2",  # ADR-0012: Docker-in-Docker needs a real host (bridge networking)
                volumes=[{"name": "docker-sock", "host_path": "/var/run/docker.sock"}],
            ),
            t,
        )
        self.service = aws.ecs.Service(
            f"{name}-service",
            name=f"{p}-eval-worker",
            cluster=self.cluster.arn,
            task_definition=self.task_definition.arn,
            desired_count=0,  # the dispatcher scales it with the eval queue; the guard sets it back to 0
            capacity_provider_strategies=[{"capacity_provider": self.capacity_provider.name, "weight": 1}],
            tags=t,
            opts=child(self, depends_on=[hosts.cluster_capacity], ignore_changes=["desiredCount"]),
        )
        self.cluster_arn = self.cluster.arn
        self.asg_name = self.asg.name
        self.task_definition_arn = self.task_definition.arn
        self.register_outputs(
            {
                "clusterArn": self.cluster_arn,
                "asgName": self.asg_name,
                "taskDefinitionArn": self.task_definition_arn,
                "serviceName": self.service.name,
            }
        )
