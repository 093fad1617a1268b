"""The whole estate: `build(cfg)` composes every component and returns the stack outputs.

`__main__.py` calls it with the stack config and exports the result; the tests call it under mocks.
"""

from __future__ import annotations

from typing import Any

import pulumi

from components.common import DEADLINE_TAG, region
from components.config import EstateConfig, harness_subnets
from components.control import BuildTier, BuildTierArgs, HeadNode, HeadNodeArgs, Judge, JudgeArgs
from components.eval_fleet import EvalFleet, EvalFleetArgs
from components.gateway import Gateway, GatewayArgs
from components.guard import NightlyGuard, NightlyGuardArgs
from components.harness import HarnessFleet, HarnessFleetArgs
from components.network import Network, NetworkArgs
from components.package_index import PackageIndex, PackageIndexArgs
from components.security import SecurityGroups, SecurityGroupsArgs
from components.state import RUNS_PREFIX, State, StateArgs

# Every key build() returns, i.e. every stack output (documented in docs/infra.md).
OUTPUT_KEYS = (
    "region",
    "vpc_id",
    "cluster_arn",
    "eval_cluster_arn",
    "gateway_cluster_arn",
    "harness_subnet_ids",
    "harness_subnet_cidrs",
    "harness_capacity",
    "eval_subnet_ids",
    "harness_security_group_id",
    "judge_security_group_id",
    "eval_security_group_id",
    "bucket",
    "runs_prefix",
    "queue_prefix",
    "deadline_tag",
    "valkey_endpoint",
    "valkey_port",
    "aurora_endpoint",
    "aurora_secret_arn",
    "gateway_url",
    "gateway_master_key_secret_arn",
    "gateway_provider_key_secret_arns",
    "gateway_provider_keys_prefix",
    "gateway_database_secret_arn",
    "gateway_cluster_name",
    "gateway_service_name",
    "run_secrets_prefix",
    "kms_key_arn",
    "verdict_key_secret_arn",
    "valkey_dispatcher_secret_arn",
    "harness_task_definition_arn",
    "judge_task_definition_arn",
    "eval_task_definition_arn",
    "eval_service_name",
    "package_index_url",
    "eval_asg_name",
    "build_asg_name",
    "head_instance_id",
    "repository_urls",
    "task_images_repository_url",
    "guard_function_name",
    "alerts_topic_arn",
)


def build(cfg: EstateConfig) -> dict[str, Any]:
    p = cfg.prefix
    net = Network(p, NetworkArgs.from_config(cfg))
    sgs = SecurityGroups(f"{p}-sg", SecurityGroupsArgs(p, net.vpc_id, net.vpc_cidrs, net.s3_prefix_list_id))
    sg = sgs.ids
    state = State(
        f"{p}-state",
        StateArgs(
            prefix=p,
            data_subnet_ids=net.subnet_ids["data"],
            aurora_sg_id=sg["aurora"],
            valkey_sg_id=sg["valkey"],
            aurora_engine_version=cfg.aurora_engine_version,
            aurora_min_acu=cfg.aurora_min_acu,
            aurora_max_acu=cfg.aurora_max_acu,
            valkey_node_type=cfg.valkey_node_type,
            valkey_engine_version=cfg.valkey_engine_version,
            protect_data=cfg.protect_data,
            log_expiry_days=cfg.log_expiry_days,
            trajectory_ia_days=cfg.trajectory_ia_days,
            trajectory_expiry_days=cfg.trajectory_expiry_days,
        ),
    )
    gw = Gateway(
        f"{p}-gateway",
        GatewayArgs(
            prefix=p,
            subnet_ids=net.subnet_ids["gateway"],
            lb_sg_id=sg["gateway_lb"],
            task_sg_id=sg["gateway_task"],
            vpc_id=net.vpc_id,
            bucket_name=state.bucket_name,
            bucket_arn=state.bucket_arn,
            key_arn=state.key_arn,
            aurora_endpoint=state.aurora_endpoint,
            valkey_endpoint=state.valkey_endpoint,
            valkey_secret_arn=state.valkey_secret_arns["gateway"],
            platform_repo_arn=state.repo_arns["platform"],
            platform_repo_url=state.repo_urls["platform"],
            image_tag=cfg.gateway_image_tag,
            providers=cfg.gateway_providers,
            replicas=cfg.gateway_replicas,
            cpu=cfg.gateway_cpu,
            memory=cfg.gateway_memory,
            log_retention_days=cfg.log_retention_days,
        ),
    )
    repos, urls = state.repo_arns, state.repo_urls
    build_tier = BuildTier(
        f"{p}-build",
        BuildTierArgs(
            prefix=p,
            subnet_ids=net.subnet_ids["build"],
            sg_id=sg["build"],
            repo_arns=list(repos.values()),
            aurora_secret_arn=state.aurora_secret_arn,
            key_arn=state.key_arn,
            instance_type=cfg.build_instance_type,
            max_instances=cfg.build_max_instances,
            disk_gb=cfg.build_disk_gb,
            task_image_expiry_days=cfg.task_image_expiry_days,
        ),
    )
    harness = HarnessFleet(
        f"{p}-harness",
        HarnessFleetArgs(
            prefix=p,
            bucket_arn=state.bucket_arn,
            key_arn=state.key_arn,
            valkey_arn=state.valkey_arn,
            valkey_secret_arn=state.valkey_secret_arns["harness"],
            task_images_repo_arn=build_tier.task_images_repo_arn,
            task_images_repo_url=build_tier.task_images_repo_url,
            queue_prefix=cfg.queue_prefix,
            cpu=cfg.harness_cpu,
            memory=cfg.harness_memory,
            ephemeral_gb=cfg.harness_ephemeral_gb,
            log_retention_days=cfg.log_retention_days,
        ),
    )
    index = PackageIndex(
        f"{p}-pkg-index",  # short: the load balancer's and target group's names are at most 32 characters
        PackageIndexArgs(
            prefix=p,
            subnet_ids=net.subnet_ids["build"],
            lb_sg_id=sg["package_index_lb"],
            task_sg_id=sg["package_index_task"],
            vpc_id=net.vpc_id,
            platform_repo_arn=repos["platform"],
            platform_repo_url=urls["platform"],
            image_tag=cfg.package_index_image_tag,
            upstream_url=cfg.package_index_upstream,
            replicas=cfg.package_index_replicas,
            log_retention_days=cfg.log_retention_days,
        ),
    )
    evalf = EvalFleet(
        f"{p}-eval",
        EvalFleetArgs(
            prefix=p,
            subnet_ids=net.subnet_ids["eval"],
            sg_id=sg["eval"],
            bucket_arn=state.bucket_arn,
            key_arn=state.key_arn,
            valkey_arn=state.valkey_arn,
            verdict_key_arn=state.verdict_key_arn,
            eval_repo_arn=repos["eval-images"],
            platform_repo_arn=repos["platform"],
            platform_repo_url=urls["platform"],
            queue_prefix=cfg.queue_prefix,
            worker_image_tag=cfg.eval_worker_image_tag,
            package_index_url=index.url,
            instance_type=cfg.eval_instance_type,
            max_instances=cfg.eval_max_instances,
            disk_gb=cfg.eval_disk_gb,
            worker_cpu=cfg.eval_worker_cpu,
            worker_memory=cfg.eval_worker_memory,
            log_retention_days=cfg.log_retention_days,
        ),
    )
    judge = Judge(
        f"{p}-judge",
        JudgeArgs(
            prefix=p,
            bucket_arn=state.bucket_arn,
            key_arn=state.key_arn,
            aurora_endpoint=state.aurora_endpoint,
            aurora_secret_arn=state.aurora_secret_arn,
            valkey_secret_arn=state.valkey_secret_arns["harness"],
            gateway_url=gw.url,
            platform_repo_arn=repos["platform"],
            platform_repo_url=urls["platform"],
            queue_prefix=cfg.queue_prefix,
            image_tag=cfg.judge_image_tag,
            cpu=cfg.judge_cpu,
            memory=cfg.judge_memory,
            log_retention_days=cfg.log_retention_days,
        ),
    )
    head = HeadNode(
        f"{p}-head",
        HeadNodeArgs(
            prefix=p,
            subnet_id=net.subnet_ids["head"][0],
            sg_id=sg["head"],
            bucket_arn=state.bucket_arn,
            key_arn=state.key_arn,
            valkey_arn=state.valkey_arn,
            queue_prefix=cfg.queue_prefix,
            harness_cluster_arn=harness.cluster_arn,
            harness_cluster_name=f"{p}-harness",
            eval_cluster_arn=evalf.cluster_arn,
            eval_cluster_name=f"{p}-eval",
            eval_service_name=f"{p}-eval-worker",
            gateway_cluster_name=gw.cluster_name,
            gateway_service_name=gw.service_name,
            task_families=[f"{p}-harness", f"{p}-judge"],
            registered_family=f"{p}-harness",
            pass_role_arns=[
                harness.task_role.arn,
                harness.execution_role.arn,
                judge.task_role.arn,
                judge.execution_role.arn,
            ],
            repo_arns=[*repos.values(), build_tier.task_images_repo_arn],
            # the results writers check verdicts with the verdict key; the dispatcher's own Valkey user; the
            # gateway replicas' database role, which the dispatcher creates (never a provider key nor the master key)
            secret_arns=[state.aurora_secret_arn, state.verdict_key_arn, state.valkey_secret_arns["dispatcher"],
                         gw.database.arn],
            # it makes each run's key secret, and a run's own provider key in the gateway's store: write, not read
            managed_secret_arns=[harness.run_secrets_arn_pattern, gw.provider_keys_arn_pattern],
            instance_type=cfg.head_instance_type,
            disk_gb=cfg.head_disk_gb,
            log_retention_days=cfg.log_retention_days,
        ),
    )
    guard = NightlyGuard(
        f"{p}-guard",
        NightlyGuardArgs(
            prefix=p,
            cluster_arns=[harness.cluster_arn, evalf.cluster_arn],
            cluster_names=[f"{p}-harness", f"{p}-eval", gw.cluster_name],
            services=[
                (gw.cluster_arn, gw.cluster_name, gw.service_name),
                (evalf.cluster_arn, f"{p}-eval", f"{p}-eval-worker"),
            ],
            asg_names=[f"{p}-eval", f"{p}-build"],
            instance_ids=[head.instance_id],
            schedule=cfg.guard_schedule,
            timezone=cfg.guard_timezone,
            deadline_schedule=cfg.deadline_schedule,
            enabled=cfg.guard_enabled,
            monthly_budget_usd=cfg.monthly_budget_usd,
            budget_emails=cfg.budget_emails,
        ),
    )

    outputs: dict[str, Any] = {
        "region": region(),
        "vpc_id": net.vpc_id,
        "cluster_arn": harness.cluster_arn,
        "eval_cluster_arn": evalf.cluster_arn,
        "gateway_cluster_arn": gw.cluster_arn,
        "harness_subnet_ids": net.subnet_ids["harness"],
        "harness_subnet_cidrs": harness_subnets(cfg),
        "harness_capacity": net.harness_capacity,
        "eval_subnet_ids": net.subnet_ids["eval"],
        "harness_security_group_id": sg["harness"],
        "judge_security_group_id": sg["judge"],
        "eval_security_group_id": sg["eval"],
        "bucket": state.bucket_name,
        "runs_prefix": RUNS_PREFIX,
        "queue_prefix": cfg.queue_prefix,
        "deadline_tag": DEADLINE_TAG,
        "valkey_endpoint": state.valkey_endpoint,
        "valkey_port": 6379,
        "aurora_endpoint": state.aurora_endpoint,
        "aurora_secret_arn": state.aurora_secret_arn,
        "gateway_url": gw.url,
        "gateway_master_key_secret_arn": gw.master_key.arn,
        "gateway_provider_key_secret_arns": {k: v.arn for k, v in gw.provider_keys.items()},
        "gateway_provider_keys_prefix": gw.provider_keys_prefix,
        "gateway_database_secret_arn": gw.database.arn,
        "gateway_cluster_name": gw.cluster_name,
        "gateway_service_name": gw.service_name,
        "run_secrets_prefix": harness.run_secrets_prefix,
        "kms_key_arn": state.key_arn,
        "verdict_key_secret_arn": state.verdict_key_arn,
        "valkey_dispatcher_secret_arn": state.valkey_secret_arns["dispatcher"],
        "harness_task_definition_arn": harness.task_definition_arn,
        "judge_task_definition_arn": judge.task_definition_arn,
        "eval_task_definition_arn": evalf.task_definition_arn,
        "eval_service_name": f"{p}-eval-worker",
        "package_index_url": index.url,
        "eval_asg_name": evalf.asg_name,
        "build_asg_name": build_tier.asg_name,
        "head_instance_id": head.instance_id,
        "repository_urls": urls,
        "task_images_repository_url": build_tier.task_images_repo_url,
        "guard_function_name": guard.function_name,
        "alerts_topic_arn": guard.alerts_topic_arn,
    }
    assert set(outputs) == set(OUTPUT_KEYS)
    return outputs


def export(outputs: dict[str, Any]) -> None:
    for k, v in outputs.items():
        pulumi.export(k, v)
