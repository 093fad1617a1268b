"""Package index: proxpi (a caching pull-through proxy of PyPI) on ECS Fargate behind an internal ALB.

Grading runs the official eval scripts, whose `pip install -e .` fetches build requirements from a package index
(pip's build isolation). The eval tier has no route out, so the estate runs one: the tasks sit in the build subnets
(NAT) and fetch from the upstream over HTTPS; only the eval hosts' security group may reach the load balancer
(components/security.py), and the eval worker relays its grading containers' pip to it (EVALPLANE_PACKAGE_INDEX).

The listener forwards only GET and HEAD under /index/ (the simple API pip reads); proxpi's cache-invalidation routes
answer 404 at the load balancer. The tasks have no task role: proxpi calls no AWS API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi

from components.common import ecr_pull_statements, logs_statements, region, role_with_policy, tags
from components.security import PACKAGE_INDEX_LB_PORT, PACKAGE_INDEX_TASK_PORT
from components.tiers import (
    FargateServiceArgs,
    ListenerRoute,
    TaskDefinitionArgs,
    awslogs,
    ecs_cluster,
    fargate_service,
    log_group,
    task_definition,
)
from eval_worker.package_index import DOWNLOAD_TIMEOUT_S, proxpi_settings

INDEX_PATH = "/index/"  # proxpi's simple API
CONTAINER = "proxpi"
CACHE_DIR = "/var/cache/proxpi"


@dataclass(frozen=True)
class PackageIndexArgs:
    prefix: str
    subnet_ids: list[pulumi.Input[str]]  # the build subnets (NAT): the upstream is on the internet
    lb_sg_id: pulumi.Input[str]
    task_sg_id: pulumi.Input[str]
    vpc_id: pulumi.Input[str]
    platform_repo_arn: pulumi.Input[str]
    platform_repo_url: pulumi.Input[str]
    image_tag: str
    upstream_url: str = ""  # a simple-API base URL over HTTPS; "" keeps proxpi's default (PyPI's simple API)
    replicas: int = 1
    cpu: int = 1024
    memory: int = 2048
    ephemeral_gb: int = 50  # Fargate task storage, which holds the file cache
    cache_gb: int = 40  # proxpi evicts the least recently used files beyond this
    threads: int = 32  # one gunicorn process (proxpi's cache lives in it), this many request threads
    log_retention_days: int = 30


class PackageIndex(pulumi.ComponentResource):
    def __init__(self, name: str, args: PackageIndexArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:eval:PackageIndex", name, None, opts)
        p = args.prefix
        t = tags(p, "package-index")

        logs = log_group(self, name, f"/{p}/package-index", args.log_retention_days, t)
        # Pull the image, write the logs; nothing else (and no task role at all).
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "package-index-exec",
            [*ecr_pull_statements([args.platform_repo_arn]), *logs_statements([logs.arn])],
            t,
        )
        self.cluster = ecs_cluster(self, name, f"{p}-package-index", t)
        environment = [{"name": k, "value": v} for k, v in proxpi_settings(
            CACHE_DIR, args.upstream_url, cache_bytes=args.cache_gb * 1024**3).items()]
        containers = pulumi.Output.all(args.platform_repo_url, logs.name, region()).apply(
            lambda a: json.dumps(
                [
                    {
                        "name": CONTAINER,
                        "image": f"{a[0]}:{args.image_tag}",
                        "essential": True,
                        "portMappings": [{"containerPort": PACKAGE_INDEX_TASK_PORT, "protocol": "tcp"}],
                        # proxpi's image runs gunicorn; these are its arguments
                        "command": ["--bind", f"0.0.0.0:{PACKAGE_INDEX_TASK_PORT}", "--threads", str(args.threads)],
                        "environment": environment,
                        "mountPoints": [{"sourceVolume": "cache", "containerPath": CACHE_DIR, "readOnly": False}],
                        "logConfiguration": awslogs(a[1], a[2], "index"),
                    }
                ]
            )
        )
        self.task_definition = task_definition(
            self,
            name,
            TaskDefinitionArgs(
                family=f"{p}-package-index",
                cpu=args.cpu,
                memory=args.memory,
                execution_role_arn=self.execution_role.arn,
                container_definitions=containers,
                ephemeral_gb=args.ephemeral_gb,
                volumes=[{"name": "cache"}],
                x86_linux=True,
            ),
            t,
        )
        svc = fargate_service(
            self,
            name,
            FargateServiceArgs(
                service_name=f"{p}-package-index",
                cluster_arn=self.cluster.arn,
                task_definition_arn=self.task_definition.arn,
                container=CONTAINER,
                container_port=PACKAGE_INDEX_TASK_PORT,
                listener_port=PACKAGE_INDEX_LB_PORT,
                replicas=args.replicas,
                subnet_ids=args.subnet_ids,
                lb_sg_id=args.lb_sg_id,
                task_sg_id=args.task_sg_id,
                vpc_id=args.vpc_id,
                health_check_path="/",  # proxpi's home page: no upstream call
                idle_timeout=DOWNLOAD_TIMEOUT_S + 60,  # a large file is fetched whole before its first byte is sent
                min_healthy_percent=100,  # grading may be running: start the new task first
                route=ListenerRoute(
                    suffix="read",
                    path_pattern=f"{INDEX_PATH}*",
                    methods=["GET", "HEAD"],
                    not_found_body="not a package index route",
                ),
            ),
            t,
        )
        self.lb, self.target_group, self.listener, self.service = svc.lb, svc.target_group, svc.listener, svc.service
        (self.read_rule,) = svc.rules

        self.url = pulumi.Output.concat("http://", self.lb.dns_name, INDEX_PATH)
        self.cluster_arn = self.cluster.arn
        self.service_name = f"{p}-package-index"
        self.register_outputs({"url": self.url, "clusterArn": self.cluster_arn, "serviceName": self.service.name})
