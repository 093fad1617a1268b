"""Gateway tier: LiteLLM replicas on ECS Fargate behind an internal Application Load Balancer.

Config comes from S3 (LiteLLM reads LITELLM_CONFIG_BUCKET_NAME / _OBJECT_KEY at start-up); provider keys
and the master key from Secrets Manager; keys, aliases and spend live in Aurora, rate counters in Valkey.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.common import child, logs_statements, region, role_with_policy, statement, tags
from components.security import GATEWAY_LB_PORT, GATEWAY_TASK_PORT
from components.state import CONFIG_PREFIX
from components.tiers import (
    FargateServiceArgs,
    TaskDefinitionArgs,
    awslogs,
    ecs_cluster,
    fargate_service,
    log_group,
    task_definition,
)

CONFIG_KEY = f"{CONFIG_PREFIX}gateway/litellm.yaml"
BASE_CONFIG = """\
# Base LiteLLM config. Model aliases (one per (model, harness) pool) are added by the dispatcher
# through the admin API and persisted in Aurora; this file only wires the shared stores.
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
  store_model_in_db: true
litellm_settings:
  cache: false
router_settings:
  redis_host: os.environ/REDIS_HOST
  redis_port: os.environ/REDIS_PORT
  redis_password: os.environ/REDIS_PASSWORD
model_list: []
"""


@dataclass(frozen=True)
class GatewayArgs:
    prefix: str
    subnet_ids: list[pulumi.Input[str]]
    lb_sg_id: pulumi.Input[str]
    task_sg_id: pulumi.Input[str]
    vpc_id: pulumi.Input[str]
    bucket_name: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    aurora_endpoint: pulumi.Input[str]
    aurora_secret_arn: pulumi.Input[str]
    valkey_endpoint: pulumi.Input[str]
    valkey_secret_arn: pulumi.Input[str]  # the gateway's Valkey user ({username, password})
    image: str
    image_tag: str
    providers: tuple[str, ...]
    replicas: int = 2
    cpu: int = 1024
    memory: int = 2048
    log_retention_days: int = 30


class Gateway(pulumi.ComponentResource):
    def __init__(self, name: str, args: GatewayArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:gateway:Gateway", name, None, opts)
        p = args.prefix
        t = tags(p, "gateway")

        self.provider_keys = aws.secretsmanager.Secret(
            f"{name}-provider-keys",
            name_prefix=f"{p}/gateway/provider-keys-",
            description="Model provider API keys (JSON: {ENV_NAME: key}); set the value out of band",
            kms_key_id=args.key_arn,
            tags=t,
            opts=child(self),
        )
        self.master_key = aws.secretsmanager.Secret(
            f"{name}-master-key",
            name_prefix=f"{p}/gateway/master-key-",
            description="LiteLLM master key (admin API: the dispatcher mints per-run virtual keys)",
            kms_key_id=args.key_arn,
            tags=t,
            opts=child(self),
        )
        self.config_object = aws.s3.BucketObjectv2(
            f"{name}-config",
            bucket=args.bucket_name,
            key=CONFIG_KEY,
            content=BASE_CONFIG,
            content_type="application/yaml",
            opts=child(self),
        )
        logs = log_group(self, name, f"/{p}/gateway", args.log_retention_days, t)
        secret_arns = [self.provider_keys.arn, self.master_key.arn, args.aurora_secret_arn, args.valkey_secret_arn]
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "gateway-exec",
            [
                *logs_statements([logs.arn]),
                statement(["secretsmanager:GetSecretValue"], secret_arns),
                statement(["kms:Decrypt"], [args.key_arn]),
            ],
            t,
        )
        self.task_role = role_with_policy(
            self,
            f"{name}-task-role",
            "ecs-tasks.amazonaws.com",
            "gateway-task",
            [
                statement(["s3:GetObject"], [pulumi.Output.concat(args.bucket_arn, "/", CONFIG_PREFIX, "gateway/*")]),
                statement(["kms:Decrypt"], [args.key_arn]),
            ],
            t,
        )

        self.cluster = ecs_cluster(self, name, f"{p}-gateway", t)
        container = pulumi.Output.all(
            logs.name, region(), args.bucket_name, args.aurora_endpoint, args.valkey_endpoint,
            self.provider_keys.arn, self.master_key.arn, args.aurora_secret_arn, args.valkey_secret_arn,
        ).apply(
            lambda a: json.dumps(
                [
                    {
                        "name": "litellm",
                        "image": f"{args.image}:{args.image_tag}",
                        "essential": True,
                        "portMappings": [{"containerPort": GATEWAY_TASK_PORT, "protocol": "tcp"}],
                        "command": ["--port", str(GATEWAY_TASK_PORT), "--num_workers", "4"],
                        "environment": [
                            {"name": "LITELLM_CONFIG_BUCKET_NAME", "value": a[2]},
                            {"name": "LITELLM_CONFIG_BUCKET_OBJECT_KEY", "value": CONFIG_KEY},
                            {"name": "DATABASE_HOST", "value": a[3]},
                            {"name": "DATABASE_NAME", "value": p.replace("-", "_")},
                            {"name": "REDIS_HOST", "value": a[4]},
                            {"name": "REDIS_PORT", "value": "6379"},
                            {"name": "REDIS_SSL", "value": "True"},
                        ],
                        "secrets": [
                            *[{"name": k, "valueFrom": f"{a[5]}:{k}::"} for k in args.providers],
                            {"name": "LITELLM_MASTER_KEY", "valueFrom": a[6]},
                            {"name": "DATABASE_USERNAME", "valueFrom": f"{a[7]}:username::"},
                            {"name": "DATABASE_PASSWORD", "valueFrom": f"{a[7]}:password::"},
                            {"name": "REDIS_USERNAME", "valueFrom": f"{a[8]}:username::"},
                            {"name": "REDIS_PASSWORD", "valueFrom": f"{a[8]}:password::"},
                        ],
                        "logConfiguration": awslogs(a[0], a[1], "gw"),
                    }
                ]
            )
        )
        self.task_definition = task_definition(
            self,
            name,
            TaskDefinitionArgs(
                family=f"{p}-gateway",
                cpu=args.cpu,
                memory=args.memory,
                execution_role_arn=self.execution_role.arn,
                task_role_arn=self.task_role.arn,
                container_definitions=container,
                x86_linux=True,
            ),
            t,
        )
        svc = fargate_service(
            self,
            name,
            FargateServiceArgs(
                service_name=f"{p}-gateway",
                cluster_arn=self.cluster.arn,
                task_definition_arn=self.task_definition.arn,
                container="litellm",
                container_port=GATEWAY_TASK_PORT,
                listener_port=GATEWAY_LB_PORT,
                replicas=args.replicas,
                subnet_ids=args.subnet_ids,
                lb_sg_id=args.lb_sg_id,
                task_sg_id=args.task_sg_id,
                vpc_id=args.vpc_id,
                health_check_path="/health/liveliness",
                idle_timeout=900,  # long model calls
                min_healthy_percent=50,
            ),
            t,
        )
        self.lb, self.target_group, self.service = svc.lb, svc.target_group, svc.service

        self.url = pulumi.Output.concat("http://", self.lb.dns_name)
        self.cluster_arn = self.cluster.arn
        self.cluster_name = f"{p}-gateway"
        self.service_name = f"{p}-gateway"
        self.register_outputs(
            {"url": self.url, "providerKeysSecretArn": self.provider_keys.arn, "masterKeySecretArn": self.master_key.arn}
        )
