"""The judge task definition, the Ray head node (the dispatcher's role), and the image build tier."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.common import (
    QUEUE_WORKER_ACTIONS,
    TIER_TAG,
    account_id,
    child,
    ecr_pull_statements,
    logs_statements,
    queue_arn_pattern,
    region,
    role_with_policy,
    run_data_statements,
    statement,
    tags,
)
from components.ec2 import AL2023_AMI, instance_profile, launch_template
from components.harness import run_secret_arn_pattern
from components.tiers import (
    AutoscalingTierArgs,
    TaskDefinitionArgs,
    autoscaling_tier,
    awslogs,
    log_group,
    task_definition,
)
from contract import task_shape, valkey_auth


# ------------------------------------------------------------------------------------------ judge
@dataclass(frozen=True)
class JudgeArgs:
    prefix: str
    bucket_arn: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    aurora_endpoint: pulumi.Input[str]
    aurora_secret_arn: pulumi.Input[str]
    valkey_secret_arn: pulumi.Input[str]  # the harness Valkey user: the judge's shims pace like tasks' do
    gateway_url: pulumi.Input[str]
    platform_repo_arn: pulumi.Input[str]
    platform_repo_url: pulumi.Input[str]
    queue_prefix: str
    image_tag: str
    cpu: int = 512
    memory: int = 1024
    log_retention_days: int = 30


class Judge(pulumi.ComponentResource):
    """A Fargate task run after the fact: reads trajectories from S3, calls the gateway, writes verdicts."""

    def __init__(self, name: str, args: JudgeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:judge:Judge", name, None, opts)
        p = args.prefix
        t = tags(p, "judge")
        logs = log_group(self, name, f"/{p}/judge", args.log_retention_days, t)
        self.execution_role = role_with_policy(
            self,
            f"{name}-exec-role",
            "ecs-tasks.amazonaws.com",
            "judge-exec",
            [
                *ecr_pull_statements([args.platform_repo_arn]),
                *logs_statements([logs.arn]),
                statement(["secretsmanager:GetSecretValue"], [args.aurora_secret_arn, args.valkey_secret_arn]),
                statement(["kms:Decrypt"], [args.key_arn]),
            ],
            t,
        )
        self.task_role = role_with_policy(
            self,
            f"{name}-task-role",
            "ecs-tasks.amazonaws.com",
            "judge-task",
            # The judge calls the gateway under a key of each pass's own, never a run's: the dispatcher mints it and
            # puts it in the run's judge-key secret, which the task reads (dispatcher/judge/ecs.py)
            [*run_data_statements(args.bucket_arn, args.key_arn, args.queue_prefix, queues="none"),
             statement(["secretsmanager:GetSecretValue"], [run_secret_arn_pattern(p, task_shape.JUDGE_KEY_SECRET)])],
            t,
        )
        containers = pulumi.Output.all(
            args.platform_repo_url, logs.name, region(), args.aurora_endpoint, args.gateway_url,
            args.aurora_secret_arn, args.valkey_secret_arn,
        ).apply(
            lambda a: json.dumps(
                [
                    {
                        "name": "judge",
                        "image": f"{a[0]}:{args.image_tag}",
                        "essential": True,
                        "environment": [
                            {"name": "DATABASE_HOST", "value": a[3]},
                            {"name": "DATABASE_NAME", "value": p.replace("-", "_")},
                            {"name": "GATEWAY_URL", "value": a[4]},
                        ],
                        "secrets": [
                            {"name": "DATABASE_USERNAME", "valueFrom": f"{a[5]}:username::"},
                            {"name": "DATABASE_PASSWORD", "valueFrom": f"{a[5]}:password::"},
                            {"name": valkey_auth.USER_ENV, "valueFrom": f"{a[6]}:username::"},
                            {"name": valkey_auth.PASSWORD_ENV, "valueFrom": f"{a[6]}:password::"},
                        ],
                        "logConfiguration": awslogs(a[1], a[2], "judge"),
                    }
                ]
            )
        )
        self.task_definition = task_definition(
            self,
            name,
            TaskDefinitionArgs(
                family=f"{p}-judge",
                cpu=args.cpu,
                memory=args.memory,
                execution_role_arn=self.execution_role.arn,
                task_role_arn=self.task_role.arn,
                container_definitions=containers,
            ),
            t,
        )
        self.task_definition_arn = self.task_definition.arn
        self.register_outputs({"taskDefinitionArn": self.task_definition_arn})


# -------------------------------------------------------------------------------------- head node
@dataclass(frozen=True)
class HeadNodeArgs:
    prefix: str
    subnet_id: pulumi.Input[str]
    sg_id: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    valkey_arn: pulumi.Input[str]
    queue_prefix: str
    harness_cluster_arn: pulumi.Input[str]
    harness_cluster_name: str
    eval_cluster_arn: pulumi.Input[str]
    eval_cluster_name: str
    eval_service_name: str
    gateway_cluster_name: str  # a run raises the gateway service's desired count to the replicas its plan sized
    gateway_service_name: str
    task_families: list[str]  # RunTask is allowed for these families (any revision) only
    registered_family: str  # the family the dispatcher registers task-image revisions in (the harness template's)
    pass_role_arns: list[pulumi.Input[str]]
    repo_arns: list[pulumi.Input[str]]
    secret_arns: list[pulumi.Input[str]]
    managed_secret_arns: list[pulumi.Input[str]] = ()  # secrets it creates, replaces and deletes but never reads
    instance_type: str = "m6i.large"
    disk_gb: int = 100
    log_retention_days: int = 30


class HeadNode(pulumi.ComponentResource):
    """A small EC2 instance for the Ray head and the long-lived dispatcher driver."""

    def __init__(self, name: str, args: HeadNodeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:head:HeadNode", name, None, opts)
        p = args.prefix
        t = tags(p, "head")
        rgn, acct = region(), account_id()

        def ecs_arn(kind: str, rest: str) -> pulumi.Output[str]:
            return pulumi.Output.concat("arn:aws:ecs:", rgn, ":", acct, f":{kind}/{rest}")

        family_arns = [ecs_arn("task-definition", f"{f}:*") for f in args.task_families]
        task_arns = [ecs_arn("task", f"{c}/*") for c in (args.harness_cluster_name, args.eval_cluster_name)]
        clusters = [args.harness_cluster_arn, args.eval_cluster_arn]
        logs = log_group(self, name, f"/{p}/dispatcher", args.log_retention_days, t)
        self.role = role_with_policy(
            self,
            f"{name}-role",
            "ec2.amazonaws.com",
            "dispatcher",
            [
                statement(["ecs:RunTask"], family_arns, condition={"ArnEquals": {"ecs:cluster": clusters}}),
                statement(["ecs:DescribeTasks", "ecs:StopTask"], task_arns),
                statement(
                    ["ecs:TagResource"], task_arns, condition={"StringEquals": {"ecs:CreateAction": "RunTask"}}
                ),
                statement(
                    ["ecs:ListTasks"], "*", condition={"ArnEquals": {"ecs:cluster": clusters}}, sid="ListTasksIsClusterScoped"
                ),
                # one revision per task image, derived from the template (RunTask cannot override an image);
                # the revisions carry the template's tier tag, which narrows the Resource-less registration
                statement(["ecs:DescribeTaskDefinition"], "*", sid="DescribeTaskDefinitionHasNoResource"),
                statement(
                    ["ecs:RegisterTaskDefinition"],
                    "*",
                    condition={"StringEquals": {f"aws:RequestTag/{TIER_TAG}": "harness"}},
                    sid="RegisterTaskDefinitionHasNoResource",
                ),
                statement(
                    ["ecs:TagResource"],
                    [ecs_arn("task-definition", f"{args.registered_family}:*")],
                    condition={"StringEquals": {"ecs:CreateAction": "RegisterTaskDefinition"}},
                ),
                statement(
                    ["ecs:DescribeServices", "ecs:UpdateService"],
                    [
                        ecs_arn("service", f"{args.eval_cluster_name}/{args.eval_service_name}"),
                        ecs_arn("service", f"{args.gateway_cluster_name}/{args.gateway_service_name}"),
                    ],
                ),
                statement(
                    ["iam:PassRole"],
                    args.pass_role_arns,
                    condition={"StringEquals": {"iam:PassedToService": "ecs-tasks.amazonaws.com"}},
                ),
                statement(
                    [
                        "sqs:CreateQueue",
                        "sqs:DeleteQueue",
                        "sqs:PurgeQueue",
                        "sqs:SetQueueAttributes",
                        "sqs:TagQueue",
                        *QUEUE_WORKER_ACTIONS,
                    ],
                    [queue_arn_pattern(args.queue_prefix)],
                ),
                *run_data_statements(args.bucket_arn, args.key_arn, args.queue_prefix),
                statement(["s3:DeleteObject"], [pulumi.Output.concat(args.bucket_arn, "/runs/*")]),
                *ecr_pull_statements(args.repo_arns),
                statement(["ecr:DescribeImages", "ecr:DescribeRepositories", "ecr:ListImages"], args.repo_arns),
                statement(["secretsmanager:GetSecretValue"], args.secret_arns),
                *([statement(["secretsmanager:CreateSecret", "secretsmanager:PutSecretValue",
                              "secretsmanager:DeleteSecret", "secretsmanager:DescribeSecret",
                              "secretsmanager:TagResource"], list(args.managed_secret_arns))]
                  if args.managed_secret_arns else []),
                statement(["elasticache:Connect"], [args.valkey_arn]),
                *logs_statements([logs.arn]),
            ],
            t,
        )
        profile = instance_profile(self, f"{name}-profile", self.role)
        script = (
            "#!/bin/bash\nset -euo pipefail\n"
            "# The head AMI is expected to carry the dispatcher (its subnet has no internet route).\n"
            "mkdir -p /etc/evalplane\n"
            "echo 'RAY_USAGE_STATS_ENABLED=0' > /etc/evalplane/env\n"
            "systemctl enable --now evalplane-dispatcher.service || true\n"
        )
        self.launch_template = launch_template(
            self,
            f"{name}-lt",
            image_id=AL2023_AMI,
            instance_type=args.instance_type,
            sg_ids=[args.sg_id],
            instance_profile_arn=profile.arn,
            disk_gb=args.disk_gb,
            script=script,
            tier_tags=t,
            for_asg=False,
        )
        self.instance = aws.ec2.Instance(
            f"{name}-instance",
            subnet_id=args.subnet_id,
            associate_public_ip_address=False,
            launch_template={"id": self.launch_template.id, "version": "$Latest"},
            tags={**t, "Name": f"{p}-head"},
            opts=child(self, ignore_changes=["launchTemplate"]),
        )
        self.instance_id = self.instance.id
        self.private_ip = self.instance.private_ip
        self.role_arn = self.role.arn
        self.register_outputs({"instanceId": self.instance_id, "roleArn": self.role_arn})


# ------------------------------------------------------------------------------------- build tier
TASK_IMAGES_REPOSITORY = "task-images"


@dataclass(frozen=True)
class BuildTierArgs:
    prefix: str
    subnet_ids: list[pulumi.Input[str]]
    sg_id: pulumi.Input[str]
    repo_arns: list[pulumi.Input[str]]  # the State repositories, the instance mirror (eval-images) among them
    aurora_secret_arn: pulumi.Input[str]  # the image build records task-image digests in PostgreSQL
    key_arn: pulumi.Input[str]
    instance_type: str = "m6i.2xlarge"
    max_instances: int = 4
    disk_gb: int = 1000
    task_image_expiry_days: int = 90


class BuildTier(pulumi.ComponentResource):
    """EC2 builders (min 0) that mirror the official per-instance images and build ours, pushing to ECR, and the
    repository of task images (an instance's image plus the runtime layer; `python -m dispatcher images`)."""

    def __init__(self, name: str, args: BuildTierArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:build:BuildTier", name, None, opts)
        p = args.prefix
        t = tags(p, "build")
        self.task_images = aws.ecr.Repository(
            f"{name}-task-images",
            name=f"{p}/{TASK_IMAGES_REPOSITORY}",
            image_tag_mutability="IMMUTABLE",
            image_scanning_configuration={"scan_on_push": True},
            encryption_configurations=[{"encryption_type": "AES256"}],
            tags=tags(p, "registry"),
            opts=child(self),
        )
        # Task images are rebuilt from their inputs whenever a spec needs them again, so old ones can go.
        aws.ecr.LifecyclePolicy(
            f"{name}-task-images-lifecycle",
            repository=self.task_images.name,
            policy=json.dumps(
                {
                    "rules": [
                        {
                            "rulePriority": 1,
                            "description": f"expire task images pushed more than {args.task_image_expiry_days} days ago",
                            "selection": {
                                "tagStatus": "any",
                                "countType": "sinceImagePushed",
                                "countUnit": "days",
                                "countNumber": args.task_image_expiry_days,
                            },
                            "action": {"type": "expire"},
                        }
                    ]
                }
            ),
            opts=child(self),
        )
        repo_arns = [*args.repo_arns, self.task_images.arn]
        role = role_with_policy(
            self,
            f"{name}-role",
            "ec2.amazonaws.com",
            "build-instance",
            [
                *ecr_pull_statements(repo_arns),
                statement(
                    [
                        "ecr:CompleteLayerUpload",
                        "ecr:DescribeImages",
                        "ecr:InitiateLayerUpload",
                        "ecr:PutImage",
                        "ecr:UploadLayerPart",
                    ],
                    repo_arns,
                ),
                statement(["secretsmanager:GetSecretValue"], [args.aurora_secret_arn]),
                statement(["kms:Decrypt"], [args.key_arn]),
            ],
            t,
        )
        script = (
            "#!/bin/bash\nset -euo pipefail\n"
            "dnf install -y docker git python3-pip\n"
            "systemctl enable --now docker\n"
            "usermod -aG docker ec2-user\n"
        )
        hosts = autoscaling_tier(
            self,
            name,
            AutoscalingTierArgs(
                asg_name=f"{p}-build",
                role=role,
                image_id=AL2023_AMI,
                instance_type=args.instance_type,
                max_instances=args.max_instances,
                disk_gb=args.disk_gb,
                subnet_ids=args.subnet_ids,
                sg_id=args.sg_id,
                script=script,
            ),
            t,
        )
        self.launch_template, self.asg = hosts.launch_template, hosts.asg
        self.asg_name = self.asg.name
        self.task_images_repo_arn = self.task_images.arn
        self.task_images_repo_url = self.task_images.repository_url
        self.register_outputs({"asgName": self.asg_name, "taskImagesRepositoryUrl": self.task_images_repo_url})
