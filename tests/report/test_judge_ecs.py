"""A run on AWS is judged by an ECS task: the estate's judge task definition, Fargate in the harness subnets under
the judge's security group, running `python -m dispatcher judge RUN --here` against the estate's gateway and
Valkey, under a gateway key of the pass's own that the dispatcher minted in the estate's database and put in a
secret the task reads (moto in server mode stands in for ECS and Secrets Manager)."""

from __future__ import annotations

import json

import boto3
from psycopg.types.json import Jsonb

from contract import aws
from contract import keys as vkeys
from dispatcher.cli import main
from dispatcher.judge import rubric
from dispatcher.judge.ecs import KEY_SECRET_ENV
from gateway import aliases, keys

PROVIDER_URL = "https://provider.invalid/v1"
KEY_NAME = "JUDGE_OPENAI_KEY"  # the provider key's name in the estate gateway's store (--api-key-env)


def estate(tmp_path, unique, provider_key: bool = True) -> tuple:
    """moto's VPC, cluster and judge task definition, the gateway's store (with the judge's provider key, or
    without), and the stack outputs naming them: -> (outputs file, cluster, subnets, judge task definition)."""
    ec2, ecs = boto3.client("ec2"), boto3.client("ecs")
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})  # moto's RunTask needs it
    subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.42.{i}.0/24")["Subnet"]["SubnetId"] for i in range(2)]
    sg = ec2.create_security_group(GroupName=f"{unique}-judge", Description="judge", VpcId=vpc)["GroupId"]
    cluster = ecs.create_cluster(clusterName=f"{unique}-harness")["cluster"]["clusterArn"]
    judge_td = ecs.register_task_definition(
        family=f"{unique}-judge", requiresCompatibilities=["FARGATE"], networkMode="awsvpc", cpu="512",
        memory="1024", containerDefinitions=[{"name": "judge", "image": "registry.invalid/evalplane:judge-latest",
                                              "memory": 1024, "essential": True}])["taskDefinition"]["taskDefinitionArn"]
    if provider_key:
        boto3.client("secretsmanager").create_secret(Name=f"{unique}/gateway/provider-keys/{KEY_NAME}",
                                                     SecretString="sk-provider-" + unique)
    outputs = {"region": "us-east-1", "cluster_arn": cluster, "eval_cluster_arn": cluster, "harness_subnet_ids": subnets,
               "harness_security_group_id": sg, "harness_task_definition_arn": "arn:harness",
               "eval_task_definition_arn": "arn:eval", "eval_service_name": "eval", "judge_task_definition_arn": judge_td,
               "judge_security_group_id": sg, "bucket": f"{unique}-bucket", "queue_prefix": "evalplane-",
               "valkey_endpoint": "valkey.invalid", "gateway_url": "http://gateway.invalid",
               "task_images_repository_url": "registry.invalid/evalplane/task-images",
               "run_secrets_prefix": f"{unique}/runs/", "gateway_provider_keys_prefix": f"{unique}/gateway/provider-keys/"}
    path = tmp_path / "stack-outputs.json"
    path.write_text(json.dumps(outputs))
    return path, cluster, subnets, judge_td


def aws_run(pg, unique, outputs_path) -> None:
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'aws', 1)",
               (unique, Jsonb({"backend": {"kind": "aws", "stack_outputs": str(outputs_path)}, "gateway": {}})))
    pg.commit()


def judge_keys(pg, unique) -> list[tuple]:
    rows = pg.execute("SELECT key_hash, revoked_at FROM gateway_keys WHERE owner = %s", (unique + ".judge",)).fetchall()
    pg.commit()
    return rows


def test_a_run_on_aws_is_judged_by_an_ecs_task(pg, valkey, moto_endpoint, tmp_path, unique, capsys):
    path, cluster, subnets, judge_td = estate(tmp_path, unique)
    aws_run(pg, unique, path)
    ecs = boto3.client("ecs")

    boto3.client("s3").create_bucket(Bucket=f"{unique}-bucket")
    rubric_file = tmp_path / "rubric.toml"
    rubric_file.write_text('name = "mine"\n[[questions]]\nid = "polite"\nquestion = "Was the agent \\"polite\\"?"\n')
    assert main(["judge", unique, "--budget-usd", "3.5", "--concurrency", "8", "--rubric", str(rubric_file),
                 "--api-key-env", KEY_NAME, "--provider-url", PROVIDER_URL]) == 0
    arn = capsys.readouterr().out.strip().split()[-1]
    (task,) = ecs.describe_tasks(cluster=cluster, tasks=[arn])["tasks"]
    assert task["taskDefinitionArn"] == judge_td and task["launchType"] == "FARGATE"
    assert any(d["name"] == "subnetId" and d["value"] in subnets for a in task["attachments"] for d in a["details"])
    (override,) = task["overrides"]["containerOverrides"]
    assert override["name"] == "judge"
    mine = rubric.load(rubric_file)
    uri = f"s3://{unique}-bucket/runs/{unique}/judge/rubrics/{mine.sha}.toml"  # the task cannot read our disk
    alias = override["command"][override["command"].index("--alias") + 1]
    assert override["command"] == ["python", "-m", "dispatcher", "judge", unique, "--here", "--provider", "openai",
                                   "--model", "gpt-4o-mini", "--api-key-env", KEY_NAME, "--budget-usd",
                                   "3.5", "--max-tokens", "1024", "--concurrency", "8", "--rubric", uri,
                                   "--alias", alias, "--base-url", "http://gateway.invalid"]
    copy = tmp_path / "copy.toml"
    copy.write_text(aws.get_text(uri))
    assert rubric.load(copy) == mine
    env = {e["name"]: e["value"] for e in override["environment"]}
    assert env["VALKEY_URL"] == "rediss://valkey.invalid:6379/0"
    # the pass's own key: in a secret of the run's (its ARN in the task's environment, the key in no override), live
    # for the judge's owner, scoped to the pass's alias alone, with the pass's budget
    key = boto3.client("secretsmanager").get_secret_value(SecretId=env[KEY_SECRET_ENV])["SecretString"]
    assert key not in json.dumps(task)
    assert boto3.client("secretsmanager").describe_secret(SecretId=env[KEY_SECRET_ENV])["Name"] == \
        f"{unique}/runs/{unique}/judge-key"
    rec = keys.from_database(pg, keys.key_hash(key))
    assert rec is not None and rec.owner == unique + ".judge" and rec.aliases == [alias] and rec.budget_usd == 3.5
    # the alias's one deployment: the judge's model at the provider, under the gateway's provider key by its name
    (deployment,) = aliases.load(pg, alias)
    assert (deployment.model, deployment.api_base, deployment.key_name) == ("openai/gpt-4o-mini", PROVIDER_URL,
                                                                           KEY_NAME)
    assert pg.execute("SELECT count(*) FROM judge_verdicts WHERE run = %s", (unique,)).fetchone()[0] == 0

    # a second pass: a key of its own, the first one's refused (the task of a killed pass cannot revoke its own)
    assert main(["judge", unique, "--api-key-env", KEY_NAME, "--provider-url", PROVIDER_URL]) == 0
    second = boto3.client("secretsmanager").get_secret_value(SecretId=env[KEY_SECRET_ENV])["SecretString"]
    assert second != key and keys.from_database(pg, keys.key_hash(key)) is None
    assert keys.from_database(pg, keys.key_hash(second)) is not None
    assert valkey.get(vkeys.gateway_key(keys.key_hash(key))) is None


def test_a_judge_on_aws_is_refused_before_any_key_or_task_is_made(pg, moto_endpoint, tmp_path, unique, capsys):
    """The estate's judge always calls its gateway (its task holds no provider key): --no-gateway, a missing
    --provider-url and a provider key the gateway's store lacks are each refused naming the flag, with no key minted
    and no task started."""
    path, cluster, _, _ = estate(tmp_path, unique, provider_key=False)
    aws_run(pg, unique, path)
    ecs = boto3.client("ecs")
    for argv, code, says in (
            (["--no-gateway", "--provider-url", PROVIDER_URL], 2, "--no-gateway: run"),
            ([], 2, "--provider-url: on AWS the judge's deployment"),
            (["--provider-url", PROVIDER_URL, "--api-key-env", KEY_NAME], 1,
             f"--api-key-env: the estate's gateway has no provider key {KEY_NAME!r}")):
        assert main(["judge", unique, *argv]) == code, argv
        assert says in capsys.readouterr().err
        assert judge_keys(pg, unique) == [] and ecs.list_tasks(cluster=cluster)["taskArns"] == []
    # --here on an AWS run (the task's own command) mints nothing on the local tier
    assert main(["judge", unique, "--here", "--gateway", "--base-url", "http://gateway.invalid"]) == 2
    assert "--gateway: with --here the judge mints its own gateway key on the local tier only" in capsys.readouterr().err
