"""SecurityGroups: one group per tier and every rule between them, in one place.

Nothing is open to the internet inbound. Egress to 0.0.0.0/0 exists only for the NAT tiers (gateway
tasks reach model providers; the build tier pulls official images; the package index fetches from its
upstream); everything else talks to the VPC (interface endpoints), the S3 prefix list (gateway endpoint)
and named peer groups. The eval hosts reach one service outside AWS's APIs and Valkey: the package index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from components.common import ANYWHERE, child, tags

GATEWAY_LB_PORT = 80
GATEWAY_TASK_PORT = 4000
VALKEY_PORT = 6379
AURORA_PORT = 5432
PACKAGE_INDEX_LB_PORT = 80
PACKAGE_INDEX_TASK_PORT = 5000  # proxpi's gunicorn
GROUPS = ("harness", "judge", "gateway_lb", "gateway_task", "eval", "head", "build", "valkey", "aurora",
          "package_index_lb", "package_index_task")


@dataclass(frozen=True)
class SecurityGroupsArgs:
    prefix: str
    vpc_id: pulumi.Input[str]
    vpc_cidrs: list[str]
    s3_prefix_list_id: pulumi.Input[str]


class SecurityGroups(pulumi.ComponentResource):
    def __init__(self, name: str, args: SecurityGroupsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:net:SecurityGroups", name, None, opts)
        self.groups: dict[str, aws.ec2.SecurityGroup] = {
            g: aws.ec2.SecurityGroup(
                f"{name}-{g.replace('_', '-')}",
                vpc_id=args.vpc_id,
                description=f"evalplane {g.replace('_', ' ')}",
                tags=tags(args.prefix, g),
                opts=child(self),
            )
            for g in GROUPS
        }
        sg = {k: v.id for k, v in self.groups.items()}
        n = 0

        def egress(group: str, port: int, **dest: Any) -> None:
            nonlocal n
            n += 1
            aws.vpc.SecurityGroupEgressRule(
                f"{name}-{group.replace('_', '-')}-out-{n}",
                security_group_id=sg[group],
                ip_protocol="tcp",
                from_port=port,
                to_port=port,
                opts=child(self),
                **dest,
            )

        def ingress(group: str, port: int, source: str) -> None:
            nonlocal n
            n += 1
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-{group.replace('_', '-')}-in-{n}",
                security_group_id=sg[group],
                ip_protocol="tcp",
                from_port=port,
                to_port=port,
                referenced_security_group_id=sg[source],
                opts=child(self),
            )

        def aws_apis(group: str) -> None:  # interface endpoints (HTTPS in the VPC) and S3 (prefix list)
            for cidr in args.vpc_cidrs:
                egress(group, 443, cidr_ipv4=cidr)
            egress(group, 443, prefix_list_id=args.s3_prefix_list_id)

        # Gateway load balancer: only harness and judge tasks, and the dispatcher (it mints per-run keys).
        for src in ("harness", "judge", "head"):
            ingress("gateway_lb", GATEWAY_LB_PORT, src)
        egress("gateway_lb", GATEWAY_TASK_PORT, referenced_security_group_id=sg["gateway_task"])
        ingress("gateway_task", GATEWAY_TASK_PORT, "gateway_lb")
        egress("gateway_task", 443, cidr_ipv4=ANYWHERE)  # model providers, through NAT
        for src in ("harness", "judge", "head"):
            egress(src, GATEWAY_LB_PORT, referenced_security_group_id=sg["gateway_lb"])
        # Valkey: pacer, progress keys, rate counters
        for src in ("harness", "judge", "gateway_task", "head", "eval"):
            ingress("valkey", VALKEY_PORT, src)
            egress(src, VALKEY_PORT, referenced_security_group_id=sg["valkey"])
        # Aurora: the gateway's key/spend tables, the results writer on the head node, the judge's verdicts,
        # the task-image digests the build tier records
        for src in ("gateway_task", "head", "judge", "build"):
            ingress("aurora", AURORA_PORT, src)
            egress(src, AURORA_PORT, referenced_security_group_id=sg["aurora"])
        for g in ("harness", "judge", "eval", "head", "gateway_task"):
            aws_apis(g)
        egress("build", 443, cidr_ipv4=ANYWHERE)  # official images, package mirrors (through NAT)
        egress("build", 80, cidr_ipv4=ANYWHERE)
        # Package index (appended last: the rules above keep their names): the eval hosts only, for the grading
        # containers' pip (relayed by the eval worker); the index fetches from its upstream over HTTPS, through NAT.
        ingress("package_index_lb", PACKAGE_INDEX_LB_PORT, "eval")
        egress("eval", PACKAGE_INDEX_LB_PORT, referenced_security_group_id=sg["package_index_lb"])
        egress("package_index_lb", PACKAGE_INDEX_TASK_PORT, referenced_security_group_id=sg["package_index_task"])
        ingress("package_index_task", PACKAGE_INDEX_TASK_PORT, "package_index_lb")
        egress("package_index_task", 443, cidr_ipv4=ANYWHERE)

        self.ids = sg
        self.register_outputs({"ids": sg})
