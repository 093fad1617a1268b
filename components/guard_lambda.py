"""The nightly guard (AWS Lambda, Python 3.12, boto3 only). Deployed inline: read as text by guard.py.

Two modes, chosen by the EventBridge Scheduler input:
  {"mode": "deadline"}  stop every task whose `evalplane:deadline` tag (ISO-8601 UTC) is in the past;
  {"mode": "nightly"}   the same, then scale every compute tier to zero: ECS services to desiredCount 0,
                        Auto Scaling groups to min/desired 0, and stop the head node instance(s).
Targets come from the environment (set by Pulumi), so the guard never lists the account:
  CLUSTERS   comma-separated cluster ARNs to sweep for overdue tasks
  SERVICES   JSON list of [clusterArn, serviceName]
  ASGS       comma-separated Auto Scaling group names
  INSTANCES  comma-separated EC2 instance ids
  DEADLINE_TAG  the tag key (default evalplane:deadline)
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime


def _csv(name: str) -> list[str]:
    return [x for x in os.environ.get(name, "").split(",") if x]


def parse_deadline(value: str) -> datetime | None:
    try:
        d = datetime.fromisoformat(value)  # Python 3.11+ reads a trailing "Z"
    except (TypeError, ValueError):
        return None
    return d if d.tzinfo else d.replace(tzinfo=UTC)


def overdue(task: dict, now: datetime, tag_key: str) -> bool:
    """A task is overdue if its deadline tag parses and is in the past (untagged tasks are left alone)."""
    for t in task.get("tags", []):
        if t.get("key") == tag_key:
            d = parse_deadline(t.get("value", ""))
            return d is not None and d < now
    return False


def sweep_deadlines(ecs, clusters: list[str], now: datetime, tag_key: str) -> list[str]:
    stopped: list[str] = []
    for cluster in clusters:
        arns: list[str] = []
        for page in ecs.get_paginator("list_tasks").paginate(cluster=cluster, desiredStatus="RUNNING"):
            arns.extend(page.get("taskArns", []))
        for i in range(0, len(arns), 100):
            tasks = ecs.describe_tasks(cluster=cluster, tasks=arns[i : i + 100], include=["TAGS"]).get("tasks", [])
            for task in tasks:
                if overdue(task, now, tag_key):
                    ecs.stop_task(cluster=cluster, task=task["taskArn"], reason="evalplane guard: run deadline passed")
                    stopped.append(task["taskArn"])
    return stopped


def scale_to_zero(ecs, autoscaling, ec2, services: list[list[str]], asgs: list[str], instances: list[str]) -> dict:
    for cluster, service in services:
        ecs.update_service(cluster=cluster, service=service, desiredCount=0)
    for name in asgs:
        autoscaling.update_auto_scaling_group(AutoScalingGroupName=name, MinSize=0, DesiredCapacity=0)
    if instances:
        ec2.stop_instances(InstanceIds=instances)
    return {"services": len(services), "asgs": len(asgs), "instances": len(instances)}


def handler(event, context, clients=None, now: datetime | None = None):
    import boto3  # the Lambda runtime provides it

    c = clients or {s: boto3.client(s) for s in ("ecs", "autoscaling", "ec2")}
    now = now or datetime.now(UTC)
    mode = (event or {}).get("mode", "nightly")
    tag_key = os.environ.get("DEADLINE_TAG", "evalplane:deadline")
    result = {"mode": mode, "stopped": sweep_deadlines(c["ecs"], _csv("CLUSTERS"), now, tag_key)}
    if mode == "nightly":
        result["scaled"] = scale_to_zero(
            c["ecs"], c["autoscaling"], c["ec2"],
            json.loads(os.environ.get("SERVICES", "[]")), _csv("ASGS"), _csv("INSTANCES"),
        )
    print(json.dumps(result))
    return result
