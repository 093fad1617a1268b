"""NightlyGuard: an EventBridge Scheduler pair driving a small Lambda, plus the AWS Budget and its alerts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_aws as aws

from components.common import DEADLINE_TAG, account_id, child, region, role_with_policy, statement, tags
from components.tiers import log_group

GUARD_CODE = Path(__file__).with_name("guard_lambda.py")


@dataclass(frozen=True)
class NightlyGuardArgs:
    prefix: str
    cluster_arns: list[pulumi.Input[str]]
    cluster_names: list[str]
    services: list[tuple[pulumi.Input[str], str, str]]  # (cluster ARN, cluster name, service name)
    asg_names: list[str]
    instance_ids: list[pulumi.Input[str]]
    schedule: str = "cron(0 2 * * ? *)"
    timezone: str = "UTC"
    deadline_schedule: str = "rate(15 minutes)"
    enabled: bool = True
    monthly_budget_usd: float = 1000.0
    budget_emails: tuple[str, ...] = ()


class NightlyGuard(pulumi.ComponentResource):
    def __init__(self, name: str, args: NightlyGuardArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:guard:NightlyGuard", name, None, opts)
        p = args.prefix
        t = tags(p, "guard")
        rgn, acct = region(), account_id()
        fn_name = f"{p}-nightly-guard"

        logs = log_group(self, name, f"/aws/lambda/{fn_name}", 30, t)

        def arn(svc: str, rest: str) -> pulumi.Output[str]:
            return pulumi.Output.concat(f"arn:aws:{svc}:", rgn, ":", acct, ":", rest)

        role = role_with_policy(
            self,
            f"{name}-role",
            "lambda.amazonaws.com",
            "guard",
            [
                statement(
                    ["ecs:ListTasks"], "*", condition={"ArnEquals": {"ecs:cluster": args.cluster_arns}},
                    sid="ListTasksIsClusterScoped",
                ),
                statement(
                    ["ecs:DescribeTasks", "ecs:StopTask"], [arn("ecs", f"task/{c}/*") for c in args.cluster_names]
                ),
                statement(["ecs:UpdateService"], [arn("ecs", f"service/{cn}/{s}") for _, cn, s in args.services]),
                statement(
                    ["autoscaling:UpdateAutoScalingGroup"],
                    [arn("autoscaling", f"autoScalingGroup:*:autoScalingGroupName/{g}") for g in args.asg_names],
                ),
                statement(["ec2:StopInstances"], [arn("ec2", pulumi.Output.concat("instance/", i)) for i in args.instance_ids]),
                statement(["logs:CreateLogStream", "logs:PutLogEvents"], [pulumi.Output.concat(logs.arn, ":*")]),
            ],
            t,
        )
        services_json = pulumi.Output.all(*[c for c, _, _ in args.services]).apply(
            lambda arns: json.dumps([[a, s[2]] for a, s in zip(arns, args.services)])
        )
        self.function = aws.lambda_.Function(
            f"{name}-fn",
            name=fn_name,
            runtime="python3.12",
            handler="index.handler",
            role=role.arn,
            timeout=300,
            memory_size=256,
            code=pulumi.AssetArchive({"index.py": pulumi.StringAsset(GUARD_CODE.read_text())}),
            environment={
                "variables": {
                    "CLUSTERS": pulumi.Output.all(*args.cluster_arns).apply(lambda a: ",".join(a)),
                    "SERVICES": services_json,
                    "ASGS": ",".join(args.asg_names),
                    "INSTANCES": pulumi.Output.all(*args.instance_ids).apply(lambda a: ",".join(a)),
                    "DEADLINE_TAG": DEADLINE_TAG,
                }
            },
            tags=t,
            opts=child(self, depends_on=[logs]),
        )
        scheduler_role = role_with_policy(
            self,
            f"{name}-scheduler-role",
            "scheduler.amazonaws.com",
            "guard-scheduler",
            [statement(["lambda:InvokeFunction"], [self.function.arn])],
            t,
        )
        state = "ENABLED" if args.enabled else "DISABLED"
        for mode, expr in (("nightly", args.schedule), ("deadline", args.deadline_schedule)):
            aws.scheduler.Schedule(
                f"{name}-{mode}",
                name=f"{p}-guard-{mode}",
                schedule_expression=expr,
                schedule_expression_timezone=args.timezone,
                flexible_time_window={"mode": "OFF"},
                state=state,
                target={"arn": self.function.arn, "role_arn": scheduler_role.arn, "input": json.dumps({"mode": mode})},
                opts=child(self),
            )

        # ---- budget and alerts
        self.alerts = aws.sns.Topic(f"{name}-alerts", name=f"{p}-alerts", tags=t, opts=child(self))
        aws.sns.TopicPolicy(
            f"{name}-alerts-policy",
            arn=self.alerts.arn,
            policy=self.alerts.arn.apply(
                lambda a: json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [
                            {
                                "Sid": "AwsBudgetsPublish",
                                "Effect": "Allow",
                                "Principal": {"Service": "budgets.amazonaws.com"},
                                "Action": "SNS:Publish",
                                "Resource": a,
                            }
                        ],
                    }
                )
            ),
            opts=child(self),
        )
        for i, email in enumerate(args.budget_emails):
            aws.sns.TopicSubscription(
                f"{name}-alerts-email-{i}", topic=self.alerts.arn, protocol="email", endpoint=email, opts=child(self)
            )
        notifications = [
            {"comparison_operator": "GREATER_THAN", "notification_type": kind, "threshold": pct,
             "threshold_type": "PERCENTAGE", "subscriber_sns_topic_arns": [self.alerts.arn]}
            for kind, pct in (("ACTUAL", 50.0), ("ACTUAL", 80.0), ("ACTUAL", 100.0), ("FORECASTED", 100.0))
        ]
        self.budget = aws.budgets.Budget(
            f"{name}-budget",
            name=f"{p}-monthly",
            budget_type="COST",
            limit_amount=f"{args.monthly_budget_usd:.2f}",
            limit_unit="USD",
            time_unit="MONTHLY",
            notifications=notifications,
            opts=child(self),
        )
        self.function_name = self.function.name
        self.alerts_topic_arn = self.alerts.arn
        self.register_outputs({"functionName": self.function_name, "alertsTopicArn": self.alerts_topic_arn})
