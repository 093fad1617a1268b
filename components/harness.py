"""Harness fleet: the ECS cluster (Fargate) and the template of every agent task's task definition.

A task is ONE container, the shape contract/task_shape.py describes: the task runner (`python -m harness <job-uri>`
from the runtime under /opt/evalplane) starts the shim as its own child, then the harness, in the instance's
environment at /testbed. Every attempt runs its own task image, and RunTask cannot override an image, so the
dispatcher registers one revision of this family per task image, derived from this template with only the image
replaced (dispatcher/launchers/task_definitions.py); the template's own image is a placeholder never run.

The template holds no upstream key: a run's revisions add its own gateway key, a secret under <prefix>/runs/ that the
dispatcher makes when the run opens and deletes when it ends (dispatcher/backends/aws.py). The execution role reads
only those and the harness Valkey user: never a provider key or the gateway's master key.
"""

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
from components.gateway import secret_arn_pattern
from components.tiers import TaskDefinitionArgs, awslogs, ecs_cluster, log_group, task_definition
from contract import task_shape, valkey_auth

TEMPLATE_IMAGE_TAG = "template-placeholder"  # every launch registers a revision with its task image instead
STATE_VOLUME = "state"
STOP_TIMEOUT_S = 120  # Fargate's maximum: on StopTask the runner stops its shim and still lands the attempt's row


@dataclass(frozen=True)
class HarnessFleetArgs:
    prefix: str
    bucket_arn: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    valkey_arn: pulumi.Input[str]
    valkey_secret_arn: pulumi.Input[str]  # the harness Valkey user ({username, password}): tasks' only credential
    task_images_repo_arn: pulumi.Input[str]
    task_images_repo_url: pulumi.Input[str]
    queue_prefix: str
    cpu: int = 1024
    memory: int = 4096
    # the task image (an instance image of ~1.1 GB compressed, several GB extracted, plus the runtime layer)
    # is pulled into ephemeral storage, next to the agent's edits and the task's working files
    ephemeral_gb: int = 30
    log_retention_days: int = 30


class HarnessFleet(pulumi.ComponentResource):
    def __init__(self, name: str, args: HarnessFleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:harness:HarnessFleet", name, None, opts)
        p = args.prefix
        t = tags(p, "harness")

        self.cluster = ecs_cluster(self, name, f"{p}-harness", t)
        aws.ecs.ClusterCapacityProviders(
            f"{name}-capacity",
            cluster_name=self.cluster.name,
            capacity_providers=["FARGATE", "FARGATE_SPOT"],
            default_capacity_provider_strategies=[{"capacity_provider": "FARGATE", "weight": 1, "base": 0}],
            opts=child(self),
        )
        self.log_group = log_group(self, name, f"/{p}/harness", args.log_retention_days, t)
        # Each run's gateway key: the task runner hands it to its shim alone (the secrets are the dispatcher's to make)
        self.run_secrets_prefix = run_secrets_prefix(p)
        self.run_secrets_arn_pattern = secret_arn_pattern(self.run_secrets_prefix)
        run_keys = run_secret_arn_pattern(p, task_shape.RUN_KEY_SECRET)  # not the judge passes' keys beside them
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "harness-exec",
            [
                *ecr_pull_statements([args.task_images_repo_arn]),
                *logs_statements([self.log_group.arn]),
                statement(["secretsmanager:GetSecretValue"], [run_keys, args.valkey_secret_arn]),
                statement(["kms:Decrypt"], [args.key_arn]),
            ],
            t,
        )
        self.task_role = role_with_policy(
            self,
            f"{name}-task-role",
            "ecs-tasks.amazonaws.com",
            "harness-task",
            [
                # results queues only (never a verdict queue: IAM, and the writer's signature check)
                *run_data_statements(args.bucket_arn, args.key_arn, args.queue_prefix, queues="task"),
                statement(["elasticache:Connect"], [args.valkey_arn]),
            ],
            t,
        )
        containers = pulumi.Output.all(
            args.task_images_repo_url, self.log_group.name, region(), args.valkey_secret_arn
        ).apply(lambda a: json.dumps([task_container(f"{a[0]}:{TEMPLATE_IMAGE_TAG}", a[1], a[2], a[3])]))
        self.task_definition = task_definition(
            self,
            name,
            TaskDefinitionArgs(
                family=f"{p}-harness",
                cpu=args.cpu,
                memory=args.memory,
                execution_role_arn=self.execution_role.arn,
                task_role_arn=self.task_role.arn,
                container_definitions=containers,
                ephemeral_gb=args.ephemeral_gb,
                volumes=[{"name": STATE_VOLUME}],
                x86_linux=True,
            ),
            t,
        )
        self.cluster_arn = self.cluster.arn
        self.task_definition_arn = self.task_definition.arn
        self.register_outputs(
            {
                "clusterArn": self.cluster_arn,
                "taskDefinitionArn": self.task_definition_arn,
                "runSecretsPrefix": self.run_secrets_prefix,
            }
        )


def run_secrets_prefix(prefix: str) -> str:
    """Names of runs' own secrets ({prefix}/runs/{run}/{name}: contract.task_shape's RUN_KEY_SECRET and
    JUDGE_KEY_SECRET), which the dispatcher makes."""
    return f"{prefix}/runs/"


def run_secret_arn_pattern(prefix: str, name: str) -> pulumi.Output[str]:
    """Every run's secret `name` (Secrets Manager appends -XXXXXX to a secret's name)."""
    return pulumi.Output.concat("arn:aws:secretsmanager:", region(), ":", account_id(), ":secret:",
                                run_secrets_prefix(prefix), "*/", name, "-*")


def task_container(image: str, log_group: str, region_name: str, valkey_secret_arn: str) -> dict:
    """The one container of every agent task (contract/task_shape.py): RunTask overrides its command and adds its
    attempt key (contract.signing.ATTEMPT_KEY_ENV) to its environment. Secrets: the Valkey user (a run's revision
    adds the run's gateway key, task_shape.UPSTREAM_KEY_ENV)."""
    return {
        "name": task_shape.CONTAINER,
        "image": image,
        "essential": True,
        "entryPoint": task_shape.ENTRYPOINT,
        "environment": [
            {"name": "EVALPLANE_STATE_DIR", "value": task_shape.STATE_DIR},
            {"name": "AWS_REGION", "value": region_name},
        ],
        "secrets": [
            {"name": valkey_auth.USER_ENV, "valueFrom": f"{valkey_secret_arn}:username::"},
            {"name": valkey_auth.PASSWORD_ENV, "valueFrom": f"{valkey_secret_arn}:password::"},
        ],
        # the agent edits /testbed in place, so the root filesystem stays writable; STATE_DIR is a task volume
        "readonlyRootFilesystem": False,
        "mountPoints": [{"sourceVolume": STATE_VOLUME, "containerPath": task_shape.STATE_DIR, "readOnly": False}],
        "linuxParameters": {"initProcessEnabled": True},  # reaps what the agent's shell commands leave behind
        "stopTimeout": STOP_TIMEOUT_S,
        "logConfiguration": awslogs(log_group, region_name, "task"),
    }
