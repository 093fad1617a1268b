"""The ECS launcher against moto in server mode (with the three RunTask workarounds and manual progression).

RunTask requests are recorded with a botocore before-call hook, so the tests assert on what the
dispatcher asked for (no public IP, only the job reference in overrides, calls per batch), not only
on what moto echoes back.
"""

from __future__ import annotations

import json
import urllib.request

import boto3
import pytest
from botocore.exceptions import ClientError

from contract.models import AttemptRef
from dispatcher.launchers.ecs import PENDING, EcsLauncher, EcsTarget, exit_code, started_by
from dispatcher.launchers.stack_outputs import StackOutputs, StackOutputsError


@pytest.fixture(scope="module")
def manual_progression(moto_endpoint):
    """Tasks stay RUNNING until stop_task (moto's default walks them to STOPPED on each describe)."""
    body = json.dumps({"model_name": "ecs::task", "transition": {"progression": "manual", "times": 1000000}})
    req = urllib.request.Request(moto_endpoint + "/moto-api/state-manager/set-transition", body.encode(), method="POST")
    urllib.request.urlopen(req).read()
    yield
    body = json.dumps({"model_name": "ecs::task", "transition": {"progression": "immediate"}})
    urllib.request.urlopen(urllib.request.Request(moto_endpoint + "/moto-api/state-manager/set-transition",
                                                  body.encode(), method="POST")).read()


class Recorder:
    """Every ECS call's parameters as the launcher passed them (one entry per attempt, retries included)."""

    def __init__(self, client):
        self.calls: list[tuple[str, dict]] = []
        client.meta.events.register("before-parameter-build.ecs.*", self._record)

    def _record(self, model, params, **kw):
        self.calls.append((model.name, dict(params)))

    def params(self, op: str) -> list[dict]:
        return [p for name, p in self.calls if name == op]


def task_def(ecs, family: str, compat: str, memory: int = 512) -> str:
    # workaround 2: container-level memory (task-level only -> TypeError in moto)
    return ecs.register_task_definition(
        family=family, requiresCompatibilities=[compat], networkMode="awsvpc" if compat == "FARGATE" else "bridge",
        cpu="256", memory=str(memory),
        containerDefinitions=[{"name": "harness" if compat == "FARGATE" else "eval-worker",
                               "image": "evalplane/harness:dev", "memory": memory, "cpu": 256,
                               "secrets": [{"name": "EVALPLANE_UPSTREAM_KEY",
                                            "valueFrom": "arn:aws:secretsmanager:us-east-1:123456789012:secret:k"}]}],
    )["taskDefinition"]["taskDefinitionArn"]


@pytest.fixture
def estate(moto_endpoint, manual_progression, unique, tmp_path):
    """A VPC (workaround 1: DNS hostnames on), private subnets, a security group, both clusters, and the
    stack-outputs file the dispatcher reads."""
    ec2, ecs = boto3.client("ec2"), boto3.client("ecs")
    vpc = ec2.create_vpc(CidrBlock="10.41.0.0/16")["Vpc"]["VpcId"]
    ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})
    subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.41.{i}.0/24")["Subnet"]["SubnetId"] for i in range(2)]
    sg = ec2.create_security_group(GroupName=f"{unique}-harness", Description="harness", VpcId=vpc)["GroupId"]
    harness_cluster = ecs.create_cluster(clusterName=f"{unique}-harness")["cluster"]["clusterArn"]
    eval_cluster = ecs.create_cluster(clusterName=f"{unique}-eval")["cluster"]["clusterArn"]
    outputs = {
        "region": "us-east-1", "vpc_id": vpc, "cluster_arn": harness_cluster, "eval_cluster_arn": eval_cluster,
        "harness_subnet_ids": subnets, "harness_security_group_id": sg,
        "harness_task_definition_arn": task_def(ecs, f"{unique}-harness", "FARGATE"),
        "eval_task_definition_arn": task_def(ecs, f"{unique}-eval", "EC2", memory=1024),
        "eval_service_name": f"{unique}-eval-worker", "judge_task_definition_arn": "arn:judge",
        "judge_security_group_id": sg, "bucket": f"{unique}-bucket", "runs_prefix": "runs/",
        "queue_prefix": "evalplane-", "deadline_tag": "evalplane:deadline", "valkey_endpoint": "valkey.internal",
        "valkey_port": 6379, "gateway_url": "http://gateway.internal", "harness_capacity": 49137,
        "gateway_cluster_arn": "arn:gw",  # an output the dispatcher does not read: kept, not required
    }
    path = tmp_path / "stack-outputs.json"
    path.write_text(json.dumps(outputs))
    return path


def make_launcher(path, **kw) -> tuple[EcsLauncher, Recorder]:
    client = boto3.client("ecs", region_name="us-east-1")
    rec = Recorder(client)
    kw.setdefault("poll_interval_s", 0.0)
    return EcsLauncher.from_stack_outputs(StackOutputs.load(path), client=client, **kw), rec


def add_container_instance(cluster: str, instance_type: str) -> str:
    ec2, ecs = boto3.client("ec2"), boto3.client("ecs")
    ami = ec2.describe_images()["Images"][0]["ImageId"]
    iid = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType=instance_type)["Instances"][0]["InstanceId"]
    return ecs.register_container_instance(cluster=cluster, instanceIdentityDocument=json.dumps({"instanceId": iid}))[
        "containerInstance"]["containerInstanceArn"]


# ---------------------------------------------------------------- stack outputs


def test_stack_outputs_name_the_missing_key(tmp_path, estate):
    data = json.loads(estate.read_text())
    out = StackOutputs.load(estate)
    assert out.harness_subnet_ids == data["harness_subnet_ids"] and out.valkey_url == "rediss://valkey.internal:6379/0"
    del data["harness_security_group_id"], data["cluster_arn"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(StackOutputsError, match="cluster_arn, harness_security_group_id"):
        StackOutputs.load(bad)
    bad.write_text("[]")
    with pytest.raises(StackOutputsError, match="JSON object"):
        StackOutputs.load(bad)


# ---------------------------------------------------------------- harness attempts on Fargate


def test_fargate_attempts_private_network_only_the_job_reference(estate, unique):
    launcher, rec = make_launcher(estate)
    out = StackOutputs.load(estate)
    refs = [AttemptRef(run=unique, instance_id=f"repo__repo-{i}", attempt=1) for i in range(23)]
    handles = launcher.launch_many([(r, f"s3://b/runs/{unique}/jobs/{r.instance_id}.json") for r in refs])

    runs = rec.params("RunTask")
    assert len(runs) == 23 and all(p["count"] == 1 for p in runs)  # one attempt, one override, one call
    for p in runs:
        assert p["launchType"] == "FARGATE" and p["taskDefinition"] == out.harness_task_definition_arn
        assert p["networkConfiguration"] == {"awsvpcConfiguration": {
            "subnets": out.harness_subnet_ids, "securityGroups": [out.harness_security_group_id],
            "assignPublicIp": "DISABLED"}}
        (override,) = p["overrides"]["containerOverrides"]
        assert set(override) == {"name", "command"} and override["name"] == "harness"
        assert override["command"][0].startswith("s3://") and len(override["command"]) == 1  # no env, no secrets
        tags = {t["key"]: t["value"] for t in p["tags"]}
        assert p["startedBy"] == started_by(unique) and tags["evalplane:run"] == unique
    sent = {p["overrides"]["containerOverrides"][0]["command"][0] for p in runs}
    assert sent == {f"s3://b/runs/{unique}/jobs/{r.instance_id}.json" for r in refs}

    assert all(h.task_id.startswith("arn:aws:ecs:") for h in handles)
    tasks = boto3.client("ecs").describe_tasks(cluster=out.cluster_arn, tasks=[h.task_id for h in handles[:3]])["tasks"]
    for t in tasks:  # moto echoes: an ENI in one of our subnets
        details = {d["name"]: d["value"] for d in t["attachments"][0]["details"]}
        assert details["subnetId"] in out.harness_subnet_ids

    # polling: still running, then stopped; DescribeTasks in batches of 100 for all handles
    before = len(rec.params("DescribeTasks"))
    assert [launcher.poll(h) for h in handles] == [None] * 23
    assert all(len(p["tasks"]) <= 100 for p in rec.params("DescribeTasks")[before:])
    launcher.stop(handles[0])
    stopped = boto3.client("ecs").describe_tasks(cluster=out.cluster_arn, tasks=[handles[0].task_id])["tasks"][0]
    assert stopped["lastStatus"] == "STOPPED"
    assert launcher.poll(handles[0]) == exit_code(stopped, "harness") is not None
    assert launcher.poll(handles[1]) is None

    # a resumed dispatcher finds the 22 still running, with their attempts, from startedBy and tags
    again, _ = make_launcher(estate)
    found = {h.ref: h.task_id for h in again.find_running(unique)}
    assert found == {h.ref: h.task_id for h in handles[1:]}


def test_exit_code_maps_stopped_container():
    running = {"lastStatus": "RUNNING", "containers": [{"name": "harness"}]}
    stopped = {"lastStatus": "STOPPED", "containers": [{"name": "shim", "exitCode": 0}, {"name": "harness", "exitCode": 3}]}
    never = {"lastStatus": "STOPPED", "containers": [{"name": "harness"}], "stoppedReason": "CannotPullContainerError"}
    assert (exit_code(running, "harness"), exit_code(stopped, "harness"), exit_code(never, "harness")) == (None, 3, -1)


def test_throttling_is_backed_off_not_lost(estate, unique):
    sleeps: list[float] = []
    launcher, rec = make_launcher(estate, sleep=sleeps.append, backoff_base_s=0.01)
    throttled = {"left": 3}

    def throttle(model, params, **kw):
        if throttled["left"]:
            throttled["left"] -= 1
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, model.name)

    launcher.ecs.meta.events.register("before-call.ecs.RunTask", throttle)
    handle = launcher.launch(AttemptRef(run=unique, instance_id="a__a-1", attempt=1), "s3://b/j.json")
    assert handle.task_id.startswith("arn:aws:ecs:") and len(sleeps) == 3
    assert len(rec.params("RunTask")) == 4  # three throttled, the fourth went through

    throttled["left"] = 100  # past the retry budget: the error surfaces instead of a silent loss
    launcher.max_throttle_tries = 4
    with pytest.raises(ClientError, match="ThrottlingException"):
        launcher.launch(AttemptRef(run=unique, instance_id="a__a-2", attempt=1), "s3://b/j.json")


# ---------------------------------------------------------------- placement failures on EC2


def test_eval_workers_go_ten_a_call_and_unplaced_ones_are_retried(estate):
    launcher, rec = make_launcher(estate, retry_interval_s=0.0)
    out = StackOutputs.load(estate)
    add_container_instance(out.eval_cluster_arn, "t3.medium")  # room for a few 1 GiB workers only

    arns = launcher.launch_eval_workers(25)
    runs = rec.params("RunTask")
    assert [p["count"] for p in runs] == [10, 10, 5] and all(p["launchType"] == "EC2" for p in runs)
    assert 0 < len(arns) < 25 and launcher.eval_deficit.count == 25 - len(arns)

    ecs = boto3.client("ecs")
    for arn in arns:  # capacity frees up: the deficit is placed by the next retry
        ecs.stop_task(cluster=out.eval_cluster_arn, task=arn)
    placed = launcher.retry_pending(force=True)
    assert placed == min(len(arns), 25 - len(arns))
    assert launcher.eval_deficit.count == 25 - len(arns) - placed


def test_unplaced_attempts_stay_pending_and_are_retried(estate, unique):
    """Harness attempts on a too-small EC2 instance: fewer placed than asked, the rest pending, then placed."""
    out = StackOutputs.load(estate)
    ecs = boto3.client("ecs")
    small = EcsTarget(out.eval_cluster_arn, out.eval_task_definition_arn, "eval-worker", "EC2")
    client = boto3.client("ecs", region_name="us-east-1")
    launcher = EcsLauncher(small, client=client, retry_interval_s=0.0, poll_interval_s=0.0)
    add_container_instance(out.eval_cluster_arn, "t3.medium")

    refs = [AttemptRef(run=unique, instance_id=f"r__r-{i}", attempt=1) for i in range(20)]
    handles = [launcher.launch(r, f"s3://b/{r.instance_id}.json") for r in refs]
    placed = [h for h in handles if h.task_id != PENDING]
    waiting = [h for h in handles if h.task_id == PENDING]
    assert placed and waiting and {h.ref for h in launcher.pending} == {h.ref for h in waiting}
    assert all(launcher.poll(h) is None for h in waiting)  # pending is "still running" to the driver, not lost

    for h in placed:
        ecs.stop_task(cluster=out.eval_cluster_arn, task=h.task_id)
        assert launcher.poll(h) is not None
    launcher.retry_pending(force=True)
    now_placed = [h for h in waiting if h.task_id != PENDING]
    assert len(now_placed) == min(len(placed), len(waiting))
    rest = [h for h in waiting if h.task_id == PENDING]
    assert rest, (len(placed), len(waiting), len(now_placed))  # 20 attempts; moto fits 7 on a t3.medium
    launcher.stop(rest[0])  # the driver's wall-time guard cancels one never placed: it then reads as exited
    assert launcher.poll(rest[0]) == -1 and rest[0].ref not in {h.ref for h in launcher.pending}
