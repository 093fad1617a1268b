"""A run on AWS is judged by an ECS task: the estate's judge task definition, Fargate in the harness subnets under
the judge's security group, running `python -m dispatcher judge RUN --here` against the estate's gateway and
Valkey (moto in server mode stands in for ECS)."""

from __future__ import annotations

import json

import boto3
from psycopg.types.json import Jsonb

from contract import aws
from dispatcher.cli import main
from dispatcher.judge import rubric


def test_a_run_on_aws_is_judged_by_an_ecs_task(pg, moto_endpoint, tmp_path, unique, capsys):
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
    outputs = {"region": "us-east-1", "cluster_arn": cluster, "eval_cluster_arn": cluster, "harness_subnet_ids": subnets,
               "harness_security_group_id": sg, "harness_task_definition_arn": "arn:harness",
               "eval_task_definition_arn": "arn:eval", "eval_service_name": "eval", "judge_task_definition_arn": judge_td,
               "judge_security_group_id": sg, "bucket": f"{unique}-bucket", "queue_prefix": "evalplane-",
               "valkey_endpoint": "valkey.invalid", "gateway_url": "http://gateway.invalid",
               "task_images_repository_url": "registry.invalid/evalplane/task-images"}
    path = tmp_path / "stack-outputs.json"
    path.write_text(json.dumps(outputs))
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'aws', 1)",
               (unique, Jsonb({"backend": {"kind": "aws", "stack_outputs": str(path)}})))
    pg.commit()

    boto3.client("s3").create_bucket(Bucket=f"{unique}-bucket")
    rubric_file = tmp_path / "rubric.toml"
    rubric_file.write_text('name = "mine"\n[[questions]]\nid = "polite"\nquestion = "Was the agent \\"polite\\"?"\n')
    assert main(["judge", unique, "--budget-usd", "3.5", "--concurrency", "8", "--rubric", str(rubric_file)]) == 0
    arn = capsys.readouterr().out.strip().split()[-1]
    (task,) = ecs.describe_tasks(cluster=cluster, tasks=[arn])["tasks"]
    assert task["taskDefinitionArn"] == judge_td and task["launchType"] == "FARGATE"
    assert any(d["name"] == "subnetId" and d["value"] in subnets for a in task["attachments"] for d in a["details"])
    (override,) = task["overrides"]["containerOverrides"]
    assert override["name"] == "judge"
    mine = rubric.load(rubric_file)
    uri = f"s3://{unique}-bucket/runs/{unique}/judge/rubrics/{mine.sha}.toml"  # the task cannot read our disk
    assert override["command"] == ["python", "-m", "dispatcher", "judge", unique, "--here", "--provider", "openai",
                                   "--model", "gpt-4o-mini", "--api-key-env", "EVALPLANE_JUDGE_KEY", "--budget-usd",
                                   "3.5", "--max-tokens", "1024", "--concurrency", "8", "--rubric", uri,
                                   "--base-url", "http://gateway.invalid"]
    copy = tmp_path / "copy.toml"
    copy.write_text(aws.get_text(uri))
    assert rubric.load(copy) == mine
    assert override["environment"] == [{"name": "VALKEY_URL", "value": "rediss://valkey.invalid:6379/0"}]
    assert pg.execute("SELECT count(*) FROM judge_verdicts WHERE run = %s", (unique,)).fetchone()[0] == 0


def test_gateway_is_refused_for_a_run_on_aws_before_any_task_starts(pg, moto_endpoint, unique, capsys):
    """The judge mints its own gateway key on the local tier only: an estate's judge task calls its gateway with
    --base-url and the key of its task definition. A stored [gateway] alone does not ask for it."""
    ecs = boto3.client("ecs")
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'aws', 1)",
               (unique, Jsonb({"backend": {"kind": "aws", "stack_outputs": "/nonexistent/outputs.json"},
                               "gateway": {}})))
    pg.commit()
    tasks_before = sum(len(ecs.list_tasks(cluster=c)["taskArns"]) for c in ecs.list_clusters()["clusterArns"])
    assert main(["judge", unique, "--gateway"]) == 2
    assert "--gateway: the judge mints its own gateway key on the local tier only" in capsys.readouterr().err
    assert sum(len(ecs.list_tasks(cluster=c)["taskArns"]) for c in ecs.list_clusters()["clusterArns"]) == tasks_before
    assert main(["judge", unique]) == 1  # without the flag: the ECS path as before (here: no stack outputs file)
