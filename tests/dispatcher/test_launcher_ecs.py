"""The ECS launcher against moto in server mode (with the three RunTask workarounds and manual progression).

RunTask requests are recorded with a botocore before-call hook, so the tests assert on what the
dispatcher asked for (no public IP, only the job reference in overrides, calls per batch), not only
on what moto echoes back. Task-image revisions are cached in the session's real PostgreSQL database.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import urllib.request

import boto3
import psycopg
import pytest
from botocore.exceptions import ClientError

from contract import task_shape, valkey_auth
from contract.models import AttemptRef
from dispatcher.backends.stack_outputs import StackOutputs, StackOutputsError
from dispatcher.launchers.ecs import PENDING, EcsLauncher, EcsTarget, exit_code, started_by
from dispatcher.launchers.task_definitions import PgRevisionCache, TaskImageError, register_fields
from plumbing.token_bucket import TokenBucket

REGISTRY = "123456789012.dkr.ecr.us-east-1.amazonaws.com"


def task_image(name: str) -> str:
    """A task image reference by digest, as the image build records it."""
    return f"{REGISTRY}/evalplane/task-images@sha256:{hashlib.sha256(name.encode()).hexdigest()}"


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
    """The harness template (the HarnessFleet's shape: one container, the task runner as entry point, the Valkey user
    as a secret; a run's revisions add its gateway key), or the eval worker's. Workaround 2: container-level memory (task-level only -> TypeError in moto)."""
    container = {"name": task_shape.CONTAINER, "entryPoint": task_shape.ENTRYPOINT,
                 "secrets": [{"name": valkey_auth.USER_ENV,
                              "valueFrom": "arn:aws:secretsmanager:us-east-1:123456789012:secret:v:username::"}],
                 "environment": [{"name": "EVALPLANE_STATE_DIR", "value": task_shape.STATE_DIR}],
                 "mountPoints": [{"sourceVolume": "state", "containerPath": task_shape.STATE_DIR, "readOnly": False}]} \
        if compat == "FARGATE" else {"name": "eval-worker"}
    return ecs.register_task_definition(
        family=family, requiresCompatibilities=[compat], networkMode="awsvpc" if compat == "FARGATE" else "bridge",
        cpu="256", memory=str(memory), volumes=[{"name": "state"}] if compat == "FARGATE" else [],
        executionRoleArn="arn:aws:iam::123456789012:role/harness-exec",
        taskRoleArn="arn:aws:iam::123456789012:role/harness-task", ephemeralStorage={"sizeInGiB": 30},
        containerDefinitions=[container | {"image": f"{REGISTRY}/evalplane/task-images:template-placeholder",
                                           "memory": memory, "cpu": 256, "essential": True}],
        tags=[{"key": "Project", "value": "evalplane"}, {"key": "evalplane:tier", "value": "harness"}],
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
    secrets = boto3.client("secretsmanager")  # the estate's verdict key and the dispatcher's Valkey user
    verdict_key = secrets.create_secret(Name=f"{unique}/eval/verdict-key", SecretString=os.urandom(32).hex())["ARN"]
    valkey_user = secrets.create_secret(Name=f"{unique}/valkey/dispatcher", SecretString=json.dumps(
        {"username": f"{unique}-dispatcher", "password": os.urandom(16).hex()}))["ARN"]
    # the gateway's: its replicas' database role, the operator's provider key (its value is never read here)
    gateway_database = secrets.create_secret(Name=f"{unique}/gateway/database", SecretString=json.dumps(
        {"username": f"{unique}_gateway", "password": os.urandom(16).hex()}))["ARN"]
    secrets.create_secret(Name=f"{unique}/gateway/provider-keys/ANTHROPIC_API_KEY", SecretString="sk-ant-operator")
    outputs = {
        "verdict_key_secret_arn": verdict_key, "valkey_dispatcher_secret_arn": valkey_user,
        "gateway_database_secret_arn": gateway_database, "run_secrets_prefix": f"{unique}/runs/",
        "gateway_provider_keys_prefix": f"{unique}/gateway/provider-keys/",
        "region": "us-east-1", "vpc_id": vpc, "cluster_arn": harness_cluster, "eval_cluster_arn": eval_cluster,
        "harness_subnet_ids": subnets, "harness_security_group_id": sg,
        "harness_task_definition_arn": task_def(ecs, f"{unique}-harness", "FARGATE"),
        "eval_task_definition_arn": task_def(ecs, f"{unique}-eval", "EC2", memory=1024),
        "eval_service_name": f"{unique}-eval-worker", "judge_task_definition_arn": "arn:judge",
        "judge_security_group_id": sg, "bucket": f"{unique}-bucket", "runs_prefix": "runs/",
        "queue_prefix": "evalplane-", "deadline_tag": "evalplane:deadline", "valkey_endpoint": "valkey.internal",
        "valkey_port": 6379, "gateway_url": "http://gateway.internal", "harness_capacity": 49137,
        "task_images_repository_url": f"{REGISTRY}/evalplane/task-images",
        "gateway_cluster_arn": "arn:gw",  # an output the dispatcher does not read: kept, not required
    }
    path = tmp_path / "stack-outputs.json"
    path.write_text(json.dumps(outputs))
    return path


def make_launcher(path, database_url: str, client_config=None, **kw) -> tuple[EcsLauncher, Recorder]:
    """A dispatcher's launcher: its own ECS client, the shared PostgreSQL revision cache."""
    client = boto3.client("ecs", region_name="us-east-1", config=client_config)
    rec = Recorder(client)
    kw.setdefault("poll_interval_s", 0.0)
    kw.setdefault("revision_cache", PgRevisionCache(database_url))
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


def test_fargate_attempts_private_network_only_the_job_reference(estate, unique, database_url):
    launcher, rec = make_launcher(estate, database_url)
    out = StackOutputs.load(estate)
    refs = [AttemptRef(run=unique, instance_id=f"repo__repo-{i}", attempt=1) for i in range(23)]
    images = {r: task_image(f"{unique}-{i % 2}") for i, r in enumerate(refs)}  # two instances' task images
    handles = launcher.launch_many([(r, f"s3://b/runs/{unique}/jobs/{r.instance_id}.json", images[r]) for r in refs])

    revisions = {p["containerDefinitions"][0]["image"]: p for p in rec.params("RegisterTaskDefinition")}
    assert set(revisions) == set(images.values())  # one revision per task image, however many attempts use it
    runs = rec.params("RunTask")
    assert len(runs) == 23 and all(p["count"] == 1 for p in runs)  # one attempt, one override, one call
    by_uri = {p["overrides"]["containerOverrides"][0]["command"][0]: p for p in runs}
    for r in refs:
        p = by_uri[f"s3://b/runs/{unique}/jobs/{r.instance_id}.json"]
        assert p["launchType"] == "FARGATE" and p["taskDefinition"] == launcher.revisions.arn(images[r])
        assert p["taskDefinition"] != out.harness_task_definition_arn  # never the template's placeholder image
        assert p["networkConfiguration"] == {"awsvpcConfiguration": {
            "subnets": out.harness_subnet_ids, "securityGroups": [out.harness_security_group_id],
            "assignPublicIp": "DISABLED"}}
        (override,) = p["overrides"]["containerOverrides"]
        assert set(override) == {"name", "command"} and override["name"] == task_shape.CONTAINER
        assert len(override["command"]) == 1  # the job URI only: no env, no secrets, no image
        tags = {t["key"]: t["value"] for t in p["tags"]}
        assert p["startedBy"] == started_by(unique) and tags["evalplane:run"] == unique
    assert set(by_uri) == {f"s3://b/runs/{unique}/jobs/{r.instance_id}.json" for r in refs}

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
    assert launcher.poll(handles[0]) == exit_code(stopped, task_shape.CONTAINER) is not None
    assert launcher.poll(handles[1]) is None

    # a resumed dispatcher finds the 22 still running, with their attempts, from startedBy and tags
    again, _ = make_launcher(estate, database_url)
    found = {h.ref: h.task_id for h in again.find_running(unique)}
    assert found == {h.ref: h.task_id for h in handles[1:]}


def test_tasks_are_sized_as_the_spec_says_and_one_stopped_for_memory_is_oom_killed(estate, unique, database_url):
    from contract.models import OOM_KILLED, TaskResources

    launcher, rec = make_launcher(estate, database_url, resources=TaskResources(cpu=2, memory_mib=4096,
                                                                                memory_limit_mib=8192))
    out = StackOutputs.load(estate)
    greedy, calm = (launcher.launch(AttemptRef(run=unique, instance_id=i, attempt=1), f"s3://b/{i}.json",
                                    task_image(f"{unique}-{i}")) for i in ("greedy", "calm"))
    for p in rec.params("RunTask"):
        assert (p["overrides"]["cpu"], p["overrides"]["memory"]) == ("2048", "8192")  # the task's size: billed
        (override,) = p["overrides"]["containerOverrides"]
        assert (override["cpu"], override["memoryReservation"], override["memory"]) == (2048, 4096, 8192)
    ecs = boto3.client("ecs")
    ecs.stop_task(cluster=out.cluster_arn, task=greedy.task_id,
                  reason="OutOfMemoryError: Container killed due to memory usage")
    ecs.stop_task(cluster=out.cluster_arn, task=calm.task_id, reason="Essential container in task exited")
    launcher.refresh()
    assert launcher.poll(greedy) is not None and launcher.poll(calm) is not None
    assert (launcher.exit_reason(greedy), launcher.exit_reason(calm)) == (OOM_KILLED, None)


def test_a_task_stopped_for_a_spot_interruption_is_spot_interrupted(estate, unique, database_url):
    from contract.models import SPOT_INTERRUPTED
    from dispatcher.launchers.ecs import stop_reason

    launcher, _ = make_launcher(estate, database_url)
    out = StackOutputs.load(estate)
    spot, other = (launcher.launch(AttemptRef(run=unique, instance_id=i, attempt=1), f"s3://b/{i}.json",
                                   task_image(f"{unique}-{i}")) for i in ("spot", "other"))
    ecs = boto3.client("ecs")
    ecs.stop_task(cluster=out.cluster_arn, task=spot.task_id, reason="Your Spot Task was interrupted.")
    ecs.stop_task(cluster=out.cluster_arn, task=other.task_id, reason="Essential container in task exited")
    launcher.refresh()
    assert launcher.poll(spot) is not None and launcher.poll(other) is not None
    assert (launcher.exit_reason(spot), launcher.exit_reason(other)) == (SPOT_INTERRUPTED, None)
    # as ECS records it on AWS: the stop code, whatever the reason's words
    assert stop_reason({"stopCode": "SpotInterruption", "containers": []}, "task") == SPOT_INTERRUPTED


def test_a_spot_share_reaches_run_task_as_the_capacity_provider_strategy(estate, unique, database_url):
    from dispatcher.launchers.ecs import spot_strategy

    assert spot_strategy(0) == () and spot_strategy(1) == (("FARGATE_SPOT", 100),)
    seen = {}
    for share, strategy in ((0.0, None), (0.7, [{"capacityProvider": "FARGATE_SPOT", "weight": 70},
                                                {"capacityProvider": "FARGATE", "weight": 30}]),
                            (1.0, [{"capacityProvider": "FARGATE_SPOT", "weight": 100}])):
        launcher, rec = make_launcher(estate, database_url, spot=share)
        handle = launcher.launch(AttemptRef(run=unique, instance_id=f"i{share}", attempt=1), "s3://b/j.json",
                                 task_image(f"{unique}-{share}"))
        [params] = rec.params("RunTask")
        assert params.get("capacityProviderStrategy") == strategy
        assert params.get("launchType") == (None if strategy else "FARGATE")  # RunTask takes one of the two
        seen[share] = handle.capacity
    # the capacity each task was placed on (RunTask's capacityProviderName), which prices it
    assert (seen[0.0], seen[1.0]) == ("on_demand", "spot") and seen[0.7] in ("on_demand", "spot")


def test_a_placed_task_is_priced_on_the_capacity_ecs_names():
    from dispatcher.launchers.ecs import EcsTarget, placed_on

    mixed = EcsTarget("c", "td", "task", capacity=(("FARGATE_SPOT", 70), ("FARGATE", 30)))
    assert placed_on({"capacityProviderName": "FARGATE_SPOT"}, mixed) == "spot"
    assert placed_on({"capacityProviderName": "FARGATE"}, mixed) == "on_demand"
    assert placed_on({}, mixed) is None and placed_on({}, EcsTarget("c", "td", "task")) == "on_demand"


def test_fargate_sizes_are_checked_naming_the_field():
    from contract.models import TaskResources
    from dispatcher.launchers.ecs import fargate_size_problem

    assert fargate_size_problem(TaskResources(cpu=1, memory_mib=2048, memory_limit_mib=4096)) is None
    assert fargate_size_problem(TaskResources(cpu=0.25, memory_mib=512, memory_limit_mib=2048)) is None
    assert fargate_size_problem(TaskResources(cpu=3, memory_mib=4096, memory_limit_mib=8192)).startswith(
        "backend.task_cpu:")
    assert fargate_size_problem(TaskResources(cpu=1, memory_mib=4096, memory_limit_mib=16384)).startswith(
        "backend.task_memory_limit:")
    assert fargate_size_problem(TaskResources(cpu=4, memory_mib=8192, memory_limit_mib=8704)).startswith(
        "backend.task_memory_limit:")  # not a whole GiB step


def test_exit_code_maps_stopped_container():
    running = {"lastStatus": "RUNNING", "containers": [{"name": "task"}]}
    stopped = {"lastStatus": "STOPPED", "containers": [{"name": "other", "exitCode": 0}, {"name": "task", "exitCode": 3}]}
    never = {"lastStatus": "STOPPED", "containers": [{"name": "task"}], "stoppedReason": "CannotPullContainerError"}
    assert (exit_code(running, "task"), exit_code(stopped, "task"), exit_code(never, "task")) == (None, 3, -1)


def test_throttling_is_backed_off_not_lost(estate, unique, database_url):
    sleeps: list[float] = []
    launcher, rec = make_launcher(estate, database_url, sleep=sleeps.append, backoff_base_s=0.01)
    image = task_image(unique)
    launcher.revisions.arn(image)  # registered up front: only RunTask is throttled here
    throttled = {"left": 3}

    def throttle(model, params, **kw):
        if throttled["left"]:
            throttled["left"] -= 1
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, model.name)

    launcher.ecs.meta.events.register("before-call.ecs.RunTask", throttle)
    handle = launcher.launch(AttemptRef(run=unique, instance_id="a__a-1", attempt=1), "s3://b/j.json", image)
    assert handle.task_id.startswith("arn:aws:ecs:") and len(sleeps) == 3
    assert len(rec.params("RunTask")) == 4  # three throttled, the fourth went through

    throttled["left"] = 100  # past the retry budget: the error surfaces instead of a silent loss
    launcher.max_throttle_tries = 4
    with pytest.raises(ClientError, match="ThrottlingException"):
        launcher.launch(AttemptRef(run=unique, instance_id="a__a-2", attempt=1), "s3://b/j.json", image)


# ---------------------------------------------------------------- task images: one revision per digest


def test_one_revision_per_task_image_registered_once_across_two_dispatchers(estate, unique, database_url):
    """Two dispatchers (two launchers, two ECS clients, one PostgreSQL) over two runs: each task image's revision
    is registered once, by whichever needed it first; RunTask runs it, and its container runs the digest."""
    out = StackOutputs.load(estate)
    ecs = boto3.client("ecs")
    a, b, c = (task_image(f"{unique}-{x}") for x in "abc")

    first, rec1 = make_launcher(estate, database_url)
    h1 = [first.launch(AttemptRef(run=f"{unique}-1", instance_id=f"i__i-{n}", attempt=1), f"s3://b/{n}.json", img)
          for n, img in enumerate([a, b, a])]
    assert [p["containerDefinitions"][0]["image"] for p in rec1.params("RegisterTaskDefinition")] == [a, b]
    assert first.revisions.registered == 2

    second, rec2 = make_launcher(estate, database_url)  # a second dispatcher, later: a second run
    h2 = [second.launch(AttemptRef(run=f"{unique}-2", instance_id=f"i__i-{n}", attempt=1), f"s3://b/{n}.json", img)
          for n, img in enumerate([a, b, c])]
    assert [p["containerDefinitions"][0]["image"] for p in rec2.params("RegisterTaskDefinition")] == [c]  # a, b cached
    assert [second.revisions.arn(x) for x in (a, b)] == [first.revisions.arn(x) for x in (a, b)]

    with psycopg.connect(database_url) as conn:
        rows = dict(conn.execute("SELECT image, arn FROM task_definitions WHERE template = %s",
                                 (out.harness_task_definition_arn,)).fetchall())
    assert rows == {x: second.revisions.arn(x) for x in (a, b, c)} and len(set(rows.values())) == 3

    # what runs: each task's task definition is its image's revision, and its container runs the digest
    tasks = {t["taskArn"]: t for t in ecs.describe_tasks(cluster=out.cluster_arn,
                                                         tasks=[h.task_id for h in h1 + h2])["tasks"]}
    for h, img in zip(h1 + h2, [a, b, a, a, b, c]):
        t = tasks[h.task_id]
        assert t["taskDefinitionArn"] == rows[img]
        (container,) = t["containers"]
        assert container["name"] == task_shape.CONTAINER and container["image"] == img

    # a revision is the template with only the image replaced (same family, roles, secrets, storage, entry point)
    template = ecs.describe_task_definition(taskDefinition=out.harness_task_definition_arn, include=["TAGS"])
    revision = ecs.describe_task_definition(taskDefinition=rows[c], include=["TAGS"])
    keep = register_fields() - {"containerDefinitions", "tags"}
    assert {k: v for k, v in revision["taskDefinition"].items() if k in keep} == \
        {k: v for k, v in template["taskDefinition"].items() if k in keep}
    (rc,), (tc,) = revision["taskDefinition"]["containerDefinitions"], template["taskDefinition"]["containerDefinitions"]
    assert rc["image"] == c and {**rc, "image": tc["image"]} == tc
    assert revision["taskDefinition"]["family"] == template["taskDefinition"]["family"]
    rtags = {t["key"]: t["value"] for t in revision["tags"]}
    assert rtags["evalplane:tier"] == "harness" and rtags["evalplane:template"] == out.harness_task_definition_arn
    assert rtags["evalplane:image-digest"] == c.rpartition("@")[2]


def test_concurrent_dispatchers_register_an_image_once(estate, unique, database_url):
    """Two dispatchers asking for the same new image at the same moment: the advisory lock lets one register."""
    image = task_image(unique)
    launchers = [make_launcher(estate, database_url) for _ in range(2)]
    barrier, arns = threading.Barrier(2), {}

    def go(i):
        barrier.wait()
        arns[i] = launchers[i][0].revisions.arn(image)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert arns[0] == arns[1]
    assert sum(len(rec.params("RegisterTaskDefinition")) for _, rec in launchers) == 1


def test_throttled_registration_is_retried(estate, unique, database_url):
    sleeps: list[float] = []
    launcher, rec = make_launcher(estate, database_url, sleep=sleeps.append, backoff_base_s=0.01)
    throttled = {"left": 2}

    def throttle(model, params, **kw):
        if throttled["left"]:
            throttled["left"] -= 1
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, model.name)

    launcher.ecs.meta.events.register("before-call.ecs.RegisterTaskDefinition", throttle)
    image = task_image(unique)
    handle = launcher.launch(AttemptRef(run=unique, instance_id="a__a-1", attempt=1), "s3://b/j.json", image)
    assert len(rec.params("RegisterTaskDefinition")) == 3 and len(sleeps) == 2  # two throttled, the third went through
    assert rec.params("RunTask")[0]["taskDefinition"] == launcher.revisions.arn(image)
    assert handle.task_id.startswith("arn:aws:ecs:")

    throttled["left"] = 100  # past the retry budget: the error surfaces, nothing is recorded for the image
    launcher.max_throttle_tries = 3
    other = task_image(unique + "-other")
    with pytest.raises(ClientError, match="ThrottlingException"):
        launcher.launch(AttemptRef(run=unique, instance_id="a__a-2", attempt=1), "s3://b/j.json", other)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM task_definitions WHERE image = %s", (other,)).fetchone()[0] == 0
    assert len(rec.params("RunTask")) == 1


@pytest.mark.alone  # each wait within 100 ms of the pacer's
def test_registrations_are_paced(estate, unique, database_url):
    """Registration has its own token bucket: a burst of new images waits its turn instead of being throttled."""
    waits: list[float] = []
    launcher, rec = make_launcher(estate, database_url, sleep=waits.append, register_rate_per_s=2.0,
                                  register_burst=1)
    for n in range(3):
        launcher.revisions.arn(task_image(f"{unique}-{n}"))
    assert len(rec.params("RegisterTaskDefinition")) == 3
    assert waits == [pytest.approx(0.5, abs=0.1), pytest.approx(1.0, abs=0.1)]  # the first one in the burst


def test_run_task_is_paced_to_the_launch_quota(estate, unique, database_url):
    """Each task started takes a token of the launch quota (rate, burst): the k-th RunTask goes no earlier than
    (k + 1 - burst) / rate, counting the time the launcher slept for tokens; eval workers take one a task."""
    waits: list[float] = []
    launcher, _ = make_launcher(estate, database_url, sleep=waits.append, launch_rate_per_s=4.0, launch_burst=3)
    t0 = time.monotonic()
    at: list[float] = []  # when each RunTask went, on the launcher's clock (real time plus the sleeps it asked for)
    launcher.ecs.meta.events.register("before-call.ecs.RunTask", lambda **kw: at.append(time.monotonic() - t0 +
                                                                                        sum(waits)))
    image = task_image(unique)
    launcher.revisions.arn(image)
    refs = [AttemptRef(run=unique, instance_id=f"q__q-{i}", attempt=1) for i in range(8)]
    for r in refs:
        launcher.launch(r, f"s3://b/{r.instance_id}.json", image)
    assert len(at) == 8 and len(waits) == 8 - 3  # the burst went at once, the rest waited their turn
    for k, t in enumerate(at):
        assert t >= (k + 1 - 3) / 4.0 - 1e-6, (k, at)
    assert launcher.launch_room() == 0
    assert "paced to 4 tasks/s (burst 3): 8 launched" in launcher.launch_report()

    out = StackOutputs.load(estate)
    add_container_instance(out.eval_cluster_arn, "m5.2xlarge")
    before = sum(waits)
    launcher.launch_eval_workers(10)  # ten tasks in one call take ten tokens: at most a burst (3) was there
    assert sum(waits) - before >= (10 - 3) / 4.0 - 1e-6


def test_token_bucket_reserves_in_order():
    now = [0.0]
    waited: list[float] = []
    bucket = TokenBucket(2.0, 2, clock=lambda: now[0], sleep=waited.append)
    assert [bucket.acquire() for _ in range(4)] == [0.0, 0.0, 0.5, 1.0]  # a burst of two, then one each 0.5 s
    now[0] = 10.0  # idle: the bucket refills to its burst, not beyond
    assert [bucket.acquire() for _ in range(3)] == [0.0, 0.0, 0.5]
    assert waited == [0.5, 1.0, 0.5]
    with pytest.raises(ValueError):
        TokenBucket(0, 1)
    assert bucket.available() == 0  # still owed
    now[0] = 20.0
    assert bucket.available() == 2 and bucket.acquire(3) == 0.5  # several tokens at once (ten tasks in a call)


def test_an_attempt_without_a_task_image_by_digest_is_refused(estate, unique, database_url):
    launcher, rec = make_launcher(estate, database_url)
    ref = AttemptRef(run=unique, instance_id="a__a-1", attempt=1)
    with pytest.raises(TaskImageError, match=r"a__a-1.*no task image.*dispatcher images"):
        launcher.launch(ref, "s3://b/j.json")
    with pytest.raises(TaskImageError, match=r"a__a-1.*'evalplane/task:latest' is not a reference by digest"):
        launcher.launch(ref, "s3://b/j.json", "evalplane/task:latest")
    assert not rec.params("RunTask") and not rec.params("RegisterTaskDefinition") and not launcher.pending


# ---------------------------------------------------------------- placement failures on EC2


def test_eval_workers_go_ten_a_call_and_unplaced_ones_are_retried(estate, database_url):
    launcher, rec = make_launcher(estate, database_url, retry_interval_s=0.0)
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


def test_unplaced_attempts_stay_pending_and_are_retried(estate, unique, database_url):
    """Harness attempts on a too-small EC2 instance: fewer placed than asked, the rest pending, then placed (on
    their task image's revision, which a retry reuses)."""
    out = StackOutputs.load(estate)
    ecs = boto3.client("ecs")
    small = EcsTarget(out.eval_cluster_arn, out.eval_task_definition_arn, "eval-worker", "EC2")
    client = boto3.client("ecs", region_name="us-east-1")
    rec = Recorder(client)
    launcher = EcsLauncher(small, client=client, retry_interval_s=0.0, poll_interval_s=0.0,
                           revision_cache=PgRevisionCache(database_url))
    add_container_instance(out.eval_cluster_arn, "t3.medium")

    image = task_image(unique)
    refs = [AttemptRef(run=unique, instance_id=f"r__r-{i}", attempt=1) for i in range(20)]
    handles = [launcher.launch(r, f"s3://b/{r.instance_id}.json", image) for r in refs]
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
    assert len(rec.params("RegisterTaskDefinition")) == 1
    assert {p["taskDefinition"] for p in rec.params("RunTask")} == {launcher.revisions.arn(image)}
    rest = [h for h in waiting if h.task_id == PENDING]
    assert rest, (len(placed), len(waiting), len(now_placed))  # 20 attempts; moto fits 7 on a t3.medium
    launcher.stop(rest[0])  # the driver's wall-time guard cancels one never placed: it then reads as exited
    assert launcher.poll(rest[0]) == -1 and rest[0].ref not in {h.ref for h in launcher.pending}
