"""Gateway tier: LiteLLM replicas on ECS Fargate behind an internal Application Load Balancer.

The replicas run what the local tier runs (gateway/): LiteLLM without its database, our `custom_auth` hook and meter
callback, the configuration `gateway.config.litellm_config()` renders (uploaded to S3 here, read by LiteLLM at
start-up) and the environment of `gateway.config.GatewaySettings` (the database and Valkey URLs, their users as ECS
secrets). Keys, aliases and meter rows live in Aurora under the gateway's own role, live keys and spend in Valkey
under its own user. The provider keys are secrets of their own under <prefix>/gateway/provider-keys/ (the
"secretsmanager" store of gateway/keyfile.py): only the replicas' task role reads them, when an alias is loaded, so
no execution role, task definition or environment holds one, and a run's key minted after start-up is found too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import yaml

from components.common import (
    account_id,
    child,
    ecr_pull_statements,
    logs_statements,
    region,
    role_with_policy,
    statement,
    tags,
)
from components.security import GATEWAY_LB_PORT, GATEWAY_TASK_PORT
from components.state import CONFIG_PREFIX, KEEP_SECRET_STRING, generated_password
from components.tiers import (
    FargateServiceArgs,
    TaskDefinitionArgs,
    awslogs,
    ecs_cluster,
    fargate_service,
    log_group,
    task_definition,
)
from gateway import config as gw

CONFIG_KEY = f"{CONFIG_PREFIX}gateway/litellm.yaml"
CONTAINER = "litellm"
WORKERS = 4  # LiteLLM (uvicorn) workers per replica
# LiteLLM's proxy, run by the platform image's Python (where the project and its lock are installed)
ENTRYPOINT = ["/opt/evalplane/bin/python3", "-m", "litellm.proxy.proxy_cli"]
VALKEY_PORT = 6379
AURORA_PORT = 5432


def provider_keys_prefix(prefix: str) -> str:
    """Secret names of the gateway's provider keys: the operator's (one per gatewayProviders name) and runs' own."""
    return f"{prefix}/gateway/provider-keys/"


def database_user(prefix: str) -> str:
    """The replicas' PostgreSQL role (the dispatcher creates it from the secret: gateway/grants.py)."""
    return prefix.replace("-", "_") + "_gateway"


def secret_arn_pattern(name_prefix: str) -> pulumi.Output[str]:
    """Every secret whose name starts with name_prefix (Secrets Manager appends -XXXXXX to a secret's name)."""
    return pulumi.Output.concat("arn:aws:secretsmanager:", region(), ":", account_id(), ":secret:", name_prefix, "*")


def replica_settings(prefix: str, aurora_endpoint: str, valkey_endpoint: str) -> gw.GatewaySettings:
    """What every replica is told (URLs without credentials: the users come as ECS secrets)."""
    return gw.GatewaySettings(
        database_url=f"postgresql://{aurora_endpoint}:{AURORA_PORT}/{prefix.replace('-', '_')}?sslmode=require",
        valkey_url=f"rediss://{valkey_endpoint}:{VALKEY_PORT}/0",
        provider_keys_store="secretsmanager",
        provider_keys_prefix=provider_keys_prefix(prefix),
    )


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
    valkey_endpoint: pulumi.Input[str]
    valkey_secret_arn: pulumi.Input[str]  # the gateway's Valkey user ({username, password})
    platform_repo_arn: pulumi.Input[str]
    platform_repo_url: pulumi.Input[str]
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

        # The operator's provider keys, one secret each (values set out of band): deployments name them
        # (a spec's model.api_key_env); a run's own provider key is put beside them by its dispatcher.
        self.provider_keys = {
            k: aws.secretsmanager.Secret(
                f"{name}-provider-key-{k.lower().replace('_', '-')}",
                name=provider_keys_prefix(p) + k,
                description=f"Provider key {k} (read only by the gateway's replicas); set the value out of band",
                kms_key_id=args.key_arn,
                tags=t,
                opts=child(self),
            )
            for k in args.providers
        }
        # LiteLLM's master key (its admin routes; nothing of ours calls them): generated, never set by hand
        self.master_key = aws.secretsmanager.Secret(
            f"{name}-master-key",
            name_prefix=f"{p}/gateway/master-key-",
            description="LiteLLM master key of the gateway replicas (generated)",
            kms_key_id=args.key_arn,
            tags=t,
            opts=child(self),
        )
        aws.secretsmanager.SecretVersion(
            f"{name}-master-key-value",
            secret_id=self.master_key.id,
            secret_string=pulumi.Output.concat("sk-", generated_password("gateway-master-key")),
            opts=child(self, ignore_changes=KEEP_SECRET_STRING),
        )
        # The replicas' own PostgreSQL role: the dispatcher creates it from this secret (gateway/grants.py)
        self.database = aws.secretsmanager.Secret(
            f"{name}-database",
            name_prefix=f"{p}/gateway/database-",
            description="The gateway replicas' PostgreSQL role {username, password} (generated)",
            kms_key_id=args.key_arn,
            tags=t,
            opts=child(self),
        )
        aws.secretsmanager.SecretVersion(
            f"{name}-database-value",
            secret_id=self.database.id,
            secret_string=pulumi.Output.json_dumps(
                {"username": database_user(p), "password": generated_password("gateway-database")}
            ),
            opts=child(self, ignore_changes=KEEP_SECRET_STRING),
        )
        self.config_object = aws.s3.BucketObjectv2(
            f"{name}-config",
            bucket=args.bucket_name,
            key=CONFIG_KEY,
            content=yaml.safe_dump(gw.litellm_config(), sort_keys=False),  # the one configuration (gateway/config.py)
            content_type="application/yaml",
            opts=child(self),
        )
        logs = log_group(self, name, f"/{p}/gateway", args.log_retention_days, t)
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "gateway-exec",
            [
                *ecr_pull_statements([args.platform_repo_arn]),
                *logs_statements([logs.arn]),
                # the master key and the two users; the provider keys are the task role's, read at run time
                statement(
                    ["secretsmanager:GetSecretValue"], [self.master_key.arn, self.database.arn, args.valkey_secret_arn]
                ),
                statement(["kms:Decrypt"], [args.key_arn]),
            ],
            t,
        )
        self.provider_keys_arn_pattern = secret_arn_pattern(provider_keys_prefix(p))
        self.task_role = role_with_policy(
            self,
            f"{name}-task-role",
            "ecs-tasks.amazonaws.com",
            "gateway-task",
            [
                statement(["s3:GetObject"], [pulumi.Output.concat(args.bucket_arn, "/", CONFIG_KEY)]),
                statement(["secretsmanager:GetSecretValue"], [self.provider_keys_arn_pattern]),
                statement(["kms:Decrypt"], [args.key_arn]),
            ],
            t,
        )

        self.cluster = ecs_cluster(self, name, f"{p}-gateway", t)
        container = pulumi.Output.all(
            logs.name, region(), args.bucket_name, args.aurora_endpoint, args.valkey_endpoint, args.platform_repo_url,
            self.master_key.arn, self.database.arn, args.valkey_secret_arn,
        ).apply(lambda a: json.dumps([gateway_container(p, f"{a[5]}:{args.image_tag}", *a[:5], *a[6:])]))
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
                container=CONTAINER,
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
        self.provider_keys_prefix = provider_keys_prefix(p)
        self.register_outputs(
            {
                "url": self.url,
                "providerKeySecretArns": {k: v.arn for k, v in self.provider_keys.items()},
                "masterKeySecretArn": self.master_key.arn,
                "databaseSecretArn": self.database.arn,
            }
        )


def gateway_container(prefix: str, image: str, log_group: str, region_name: str, bucket: str, aurora_endpoint: str,
                      valkey_endpoint: str, master_key_arn: str, database_arn: str, valkey_secret_arn: str) -> dict:
    """The replica's one container: LiteLLM with the S3 configuration, GatewaySettings' environment, and as ECS
    secrets only the master key and the database and Valkey users (never a provider key)."""
    env = replica_settings(prefix, aurora_endpoint, valkey_endpoint).env() | {
        "LITELLM_CONFIG_BUCKET_NAME": bucket,
        "LITELLM_CONFIG_BUCKET_OBJECT_KEY": CONFIG_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the bundled price table: no fetch at start-up
        "AWS_REGION": region_name,
    }
    return {
        "name": CONTAINER,
        "image": image,
        "essential": True,
        "entryPoint": ENTRYPOINT,
        "command": ["--host", "0.0.0.0", "--port", str(GATEWAY_TASK_PORT), "--num_workers", str(WORKERS)],
        "portMappings": [{"containerPort": GATEWAY_TASK_PORT, "protocol": "tcp"}],
        "environment": [{"name": k, "value": v} for k, v in env.items()],
        "secrets": [
            {"name": gw.MASTER_KEY_ENV, "valueFrom": master_key_arn},
            {"name": gw.DATABASE_USER_ENV, "valueFrom": f"{database_arn}:username::"},
            {"name": gw.DATABASE_PASSWORD_ENV, "valueFrom": f"{database_arn}:password::"},
            {"name": gw.VALKEY_USER_ENV, "valueFrom": f"{valkey_secret_arn}:username::"},
            {"name": gw.VALKEY_PASSWORD_ENV, "valueFrom": f"{valkey_secret_arn}:password::"},
        ],
        "logConfiguration": awslogs(log_group, region_name, "gw"),
    }
