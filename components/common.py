"""Small helpers shared by the components: tags, child options, IAM documents, account/region."""

from __future__ import annotations

import json
from typing import Any

import pulumi
import pulumi_aws as aws

TIER_TAG = "evalplane:tier"
EGRESS_TAG = "evalplane:egress"  # "none" (no default route), "nat" or "igw"
DEADLINE_TAG = "evalplane:deadline"  # ISO-8601 UTC on run tasks; the guard stops tasks past it
ANYWHERE = "0.0.0.0/0"


def tags(prefix: str, tier: str, **extra: str) -> dict[str, str]:
    return {"Project": prefix, TIER_TAG: tier, **extra}


def child(parent: pulumi.Resource, **kw: Any) -> pulumi.ResourceOptions:
    """Options for a component's child: always parented to the component."""
    return pulumi.ResourceOptions(parent=parent, **kw)


def account_id() -> pulumi.Output[str]:
    return aws.get_caller_identity_output().account_id


def region() -> pulumi.Output[str]:
    return aws.get_region_output().region


def statement(actions: list[str], resources: Any, condition: dict | None = None, sid: str | None = None) -> dict:
    st: dict[str, Any] = {"Effect": "Allow", "Action": actions, "Resource": resources}
    if condition:
        st["Condition"] = condition
    if sid:
        st["Sid"] = sid
    return st


def policy_json(statements: list[Any]) -> pulumi.Output[str]:
    """A policy document from statements that may contain Outputs (resolved, then serialised)."""
    return pulumi.Output.from_input({"Version": "2012-10-17", "Statement": statements}).apply(
        lambda doc: json.dumps(doc, sort_keys=True)
    )


def assume_role(service: str) -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}
            ],
        }
    )


def role_with_policy(
    parent: pulumi.Resource,
    name: str,
    service: str,
    policy_name: str,
    statements: list[Any],
    tier_tags: dict[str, str],
) -> aws.iam.Role:
    """An IAM role with exactly one inline policy (no managed policies: every grant is reviewable here).

    `policy_name` is the key of the role's entry in policy/rules.py WILDCARD_ALLOWLIST.
    """
    role = aws.iam.Role(name, assume_role_policy=assume_role(service), tags=tier_tags, opts=child(parent))
    aws.iam.RolePolicy(
        f"{name}-policy",
        role=role.id,
        name=policy_name,
        policy=policy_json(statements),
        opts=child(parent),
    )
    return role


def ecr_pull_statements(repo_arns: list[Any]) -> list[dict]:
    return [
        statement(["ecr:GetAuthorizationToken"], "*", sid="EcrAuthTokenHasNoResource"),
        statement(
            ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"],
            repo_arns,
        ),
    ]


def logs_statements(log_group_arns: list[Any]) -> list[dict]:
    return [
        statement(
            ["logs:CreateLogStream", "logs:PutLogEvents"],
            [pulumi.Output.concat(a, ":*") for a in log_group_arns],
        )
    ]


# The per-run queues, as dispatcher/backends/resources.py names them: `<queuePrefix>ep-<run>-<kind>` (tests/infra checks that
# the dispatcher's names match these).
RESULTS_QUEUES = "ep-*-results"  # tasks' ledger batches and results
EVAL_QUEUES = "ep-*-eval"  # eval jobs
VERDICT_QUEUES = "ep-*-verdicts"  # verdicts: only the eval role may send here


def queue_arn_pattern(queue_prefix: str, names: str = "*") -> pulumi.Output[str]:
    """Per-run queues: every one (names "*"), or those whose names (after the prefix) match `names`."""
    return pulumi.Output.concat("arn:aws:sqs:", region(), ":", account_id(), ":", queue_prefix, names)


def deny(actions: list[str], resources: Any, sid: str | None = None) -> dict:
    st: dict[str, Any] = {"Effect": "Deny", "Action": actions, "Resource": resources}
    if sid:
        st["Sid"] = sid
    return st


QUEUE_WORKER_ACTIONS = [
    "sqs:ChangeMessageVisibility",
    "sqs:DeleteMessage",
    "sqs:GetQueueAttributes",
    "sqs:GetQueueUrl",
    "sqs:ReceiveMessage",
    "sqs:SendMessage",
]


def queue_statements(queue_prefix: str, queues: str) -> list[dict]:
    """What a role may do with the per-run queues. "all": everything (the dispatcher and its writers); "task": send
    to results queues only, and never to a verdict queue (an explicit deny: no other grant can lift it); "eval":
    consume eval queues and send to verdict queues only; "none": nothing."""
    if queues == "all":
        return [statement(QUEUE_WORKER_ACTIONS, [queue_arn_pattern(queue_prefix)])]
    if queues == "task":
        return [
            statement(["sqs:SendMessage", "sqs:GetQueueUrl"], [queue_arn_pattern(queue_prefix, RESULTS_QUEUES)]),
            deny(["sqs:SendMessage"], [queue_arn_pattern(queue_prefix, VERDICT_QUEUES)], sid="NoVerdictsFromTasks"),
        ]
    if queues == "eval":
        return [
            statement([a for a in QUEUE_WORKER_ACTIONS if a != "sqs:SendMessage"],
                      [queue_arn_pattern(queue_prefix, EVAL_QUEUES)]),
            statement(["sqs:SendMessage", "sqs:GetQueueUrl"], [queue_arn_pattern(queue_prefix, VERDICT_QUEUES)]),
        ]
    if queues == "none":
        return []
    raise ValueError(f"queues: {queues!r} is not all, task, eval or none")


def run_data_statements(
    bucket_arn: Any, key_arn: Any, queue_prefix: str, runs_prefix: str = "runs/", write: bool = True,
    queues: str = "all",
) -> list[dict]:
    """S3 under the runs prefix, the per-run queues (queue_statements), and the bucket key."""
    obj_actions = ["s3:GetObject", "s3:GetObjectTagging"]
    if write:
        obj_actions += ["s3:PutObject", "s3:PutObjectTagging"]
    return [
        statement(obj_actions, [pulumi.Output.concat(bucket_arn, "/", runs_prefix, "*")]),
        statement(
            ["s3:ListBucket"], [bucket_arn], condition={"StringLike": {"s3:prefix": [f"{runs_prefix}*"]}}
        ),
        *queue_statements(queue_prefix, queues),
        statement(["kms:Decrypt", "kms:GenerateDataKey"], [key_arn]),
    ]
