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
import pulumi_aws as aws

from components.common import child, ecr_pull_statements, logs_statements, region, role_with_policy, tags
from components.security import PACKAGE_INDEX_LB_PORT, PACKAGE_INDEX_TASK_PORT
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

        log_group = aws.cloudwatch.LogGroup(
            f"{name}-logs", name=f"/{p}/package-index", retention_in_days=args.log_retention_days, tags=t,
            opts=child(self),
        )
        # Pull the image, write the logs; nothing else (and no task role at all).
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "package-index-exec",
            [*ecr_pull_statements([args.platform_repo_arn]), *logs_statements([log_group.arn])],
            t,
        )
        self.cluster = aws.ecs.Cluster(
            f"{name}-cluster",
            name=f"{p}-package-index",
            settings=[{"name": "containerInsights", "value": "enabled"}],
            tags=t,
            opts=child(self),
        )
        environment = [{"name": k, "value": v} for k, v in proxpi_settings(
            CACHE_DIR, args.upstream_url, cache_bytes=args.cache_gb * 1024**3).items()]
        containers = pulumi.Output.all(args.platform_repo_url, log_group.name, region()).apply(
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
                        "logConfiguration": {
                            "logDriver": "awslogs",
                            "options": {"awslogs-group": a[1], "awslogs-region": a[2], "awslogs-stream-prefix": "index"},
                        },
                    }
                ]
            )
        )
        self.task_definition = aws.ecs.TaskDefinition(
            f"{name}-task",
            family=f"{p}-package-index",
            requires_compatibilities=["FARGATE"],
            network_mode="awsvpc",
            cpu=str(args.cpu),
            memory=str(args.memory),
            execution_role_arn=self.execution_role.arn,
            container_definitions=containers,
            ephemeral_storage={"size_in_gib": args.ephemeral_gb},
            volumes=[{"name": "cache"}],
            runtime_platform={"operating_system_family": "LINUX", "cpu_architecture": "X86_64"},
            tags=t,
            opts=child(self),
        )

        self.lb = aws.lb.LoadBalancer(
            f"{name}-alb",
            internal=True,
            load_balancer_type="application",
            subnets=args.subnet_ids,
            security_groups=[args.lb_sg_id],
            drop_invalid_header_fields=True,
            idle_timeout=DOWNLOAD_TIMEOUT_S + 60,  # a large file is fetched whole before its first byte is sent
            tags=t,
            opts=child(self),
        )
        self.target_group = aws.lb.TargetGroup(
            f"{name}-tg",
            port=PACKAGE_INDEX_TASK_PORT,
            protocol="HTTP",
            target_type="ip",
            vpc_id=args.vpc_id,
            deregistration_delay=60,
            health_check={"path": "/", "matcher": "200", "interval": 15},  # proxpi's home page: no upstream call
            tags=t,
            opts=child(self),
        )
        self.listener = aws.lb.Listener(
            f"{name}-listener",
            load_balancer_arn=self.lb.arn,
            port=PACKAGE_INDEX_LB_PORT,
            protocol="HTTP",
            default_actions=[
                {
                    "type": "fixed-response",
                    "fixed_response": {"content_type": "text/plain", "status_code": "404",
                                       "message_body": "not a package index route"},
                }
            ],
            opts=child(self),
        )
        self.read_rule = aws.lb.ListenerRule(
            f"{name}-read",
            listener_arn=self.listener.arn,
            priority=10,
            conditions=[
                {"path_pattern": {"values": [f"{INDEX_PATH}*"]}},
                {"http_request_method": {"values": ["GET", "HEAD"]}},
            ],
            actions=[{"type": "forward", "target_group_arn": self.target_group.arn}],
            tags=t,
            opts=child(self),
        )
        self.service = aws.ecs.Service(
            f"{name}-service",
            name=f"{p}-package-index",
            cluster=self.cluster.arn,
            task_definition=self.task_definition.arn,
            desired_count=args.replicas,
            launch_type="FARGATE",
            network_configuration={
                "subnets": args.subnet_ids,
                "security_groups": [args.task_sg_id],
                "assign_public_ip": False,
            },
            load_balancers=[
                {"target_group_arn": self.target_group.arn, "container_name": CONTAINER,
                 "container_port": PACKAGE_INDEX_TASK_PORT}
            ],
            deployment_minimum_healthy_percent=100,  # grading may be running: start the new task first
            deployment_maximum_percent=200,
            deployment_circuit_breaker={"enable": True, "rollback": True},
            tags=t,
            opts=child(self, depends_on=[self.listener, self.read_rule]),
        )

        self.url = pulumi.Output.concat("http://", self.lb.dns_name, INDEX_PATH)
        self.cluster_arn = self.cluster.arn
        self.service_name = f"{p}-package-index"
        self.register_outputs({"url": self.url, "clusterArn": self.cluster_arn, "serviceName": self.service.name})
