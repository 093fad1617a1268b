"""Helpers for the EC2 tiers: instance roles/profiles and hardened launch templates."""

from __future__ import annotations

import base64
from typing import Any

import pulumi
import pulumi_aws as aws

from components.common import child

AL2023_ECS_AMI = "resolve:ssm:/aws/service/ecs/optimized-ami/amazon-linux-2023/recommended/image_id"
AL2023_AMI = "resolve:ssm:/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
# 1: no container on any tier may use the instance role (ECS agent: host network; tasks: task roles; builds: host).
IMDS_HOP_LIMIT = 1


def user_data(script: pulumi.Input[str]) -> pulumi.Output[str]:
    return pulumi.Output.from_input(script).apply(lambda s: base64.b64encode(s.encode()).decode())


def launch_template(
    parent: pulumi.Resource,
    name: str,
    *,
    image_id: str,
    instance_type: str,
    sg_ids: list[Any],
    instance_profile_arn: Any,
    disk_gb: int,
    script: pulumi.Input[str],
    tier_tags: dict[str, str],
    for_asg: bool = True,
) -> aws.ec2.LaunchTemplate:
    """No public IP, IMDSv2 only and unreachable from containers (IMDS_HOP_LIMIT), encrypted gp3 root volume sized
    for the tier's images.

    For an Auto Scaling group the template carries the network interface (no public IP); a single
    instance sets its subnet itself, so its template only names the security groups.
    """
    net: dict[str, Any] = (
        {
            "network_interfaces": [
                {"associate_public_ip_address": "false", "security_groups": sg_ids, "delete_on_termination": "true"}
            ]
        }
        if for_asg
        else {"vpc_security_group_ids": sg_ids}
    )
    return aws.ec2.LaunchTemplate(
        name,
        image_id=image_id,
        instance_type=instance_type,
        update_default_version=True,
        iam_instance_profile={"arn": instance_profile_arn},
        **net,
        metadata_options={"http_tokens": "required", "http_endpoint": "enabled", "http_put_response_hop_limit": IMDS_HOP_LIMIT},
        block_device_mappings=[
            {
                "device_name": "/dev/xvda",
                "ebs": {"volume_size": disk_gb, "volume_type": "gp3", "encrypted": "true", "delete_on_termination": "true"},
            }
        ],
        user_data=user_data(script),
        tag_specifications=[{"resource_type": "instance", "tags": tier_tags}, {"resource_type": "volume", "tags": tier_tags}],
        tags=tier_tags,
        opts=child(parent),
    )


def instance_profile(parent: pulumi.Resource, name: str, role: aws.iam.Role) -> aws.iam.InstanceProfile:
    return aws.iam.InstanceProfile(name, role=role.name, opts=child(parent))
