"""The HarnessFleet's task definition is the task shape the task runner and the ECS launcher expect
(contract/task_shape.py), and the revision the launcher registers from it differs from it only in the image."""

from __future__ import annotations

import fnmatch
import json

import boto3

from contract import task_shape, valkey_auth
from dispatcher.backends.stack_outputs import StackOutputs
from dispatcher.launchers.ecs import EcsLauncher
from dispatcher.launchers.task_definitions import derive_revision, register_fields

DIGEST = "123456789012.dkr.ecr.us-east-1.amazonaws.com/evalplane/task-images@sha256:" + "ab" * 32


def _template(snapshot):
    return snapshot.one("aws:ecs/taskDefinition:TaskDefinition", "evalplane-harness-task")


def _containers(snapshot) -> list[dict]:
    return json.loads(_template(snapshot).inputs["containerDefinitions"])


def test_one_container_named_as_the_launcher_overrides_it(estate_snapshot):
    s = estate_snapshot
    (task,) = _containers(s)  # one container: no shim sidecar
    assert task["name"] == task_shape.CONTAINER
    launcher = EcsLauncher.from_stack_outputs(StackOutputs.model_validate(s.outputs),
                                              client=boto3.client("ecs", region_name="us-east-1"))
    assert launcher.harness.container == task["name"]  # the container RunTask's override names
    assert launcher.harness.task_definition == s.outputs["harness_task_definition_arn"] == _template(s).outputs["arn"]


def test_the_task_runner_is_the_entrypoint_and_the_job_uri_its_only_argument(estate_snapshot):
    (task,) = _containers(estate_snapshot)
    assert task["entryPoint"] == task_shape.ENTRYPOINT
    assert "command" not in task  # RunTask's override supplies the job's S3 URI, and only that
    assert task["essential"] is True


def test_the_template_holds_no_upstream_key_only_the_valkey_user(estate_snapshot):
    """A run's revisions add the run's own gateway key (dispatcher/backends/aws.py); the template has none, and no
    shared key exists for every run."""
    s = estate_snapshot
    (task,) = _containers(s)
    valkey_user = s.one("aws:secretsmanager/secret:Secret", "evalplane-state-valkey-harness-secret").outputs["arn"]
    assert task["secrets"] == [{"name": valkey_auth.USER_ENV, "valueFrom": f"{valkey_user}:username::"},
                               {"name": valkey_auth.PASSWORD_ENV, "valueFrom": f"{valkey_user}:password::"}]
    assert task_shape.UPSTREAM_KEY_ENV not in json.dumps(task)
    assert not [x for x in s.of("aws:secretsmanager/secret:Secret") if "harness" in x.name and "valkey" not in x.name]


def test_no_ports_sidecars_or_health_checks(estate_snapshot):
    (task,) = _containers(estate_snapshot)
    for absent in ("portMappings", "dependsOn", "healthCheck", "links", "volumesFrom"):
        assert absent not in task, absent


def test_state_dir_is_writable_and_storage_holds_an_instance_image(estate_snapshot):
    td = _template(estate_snapshot)
    (task,) = _containers(estate_snapshot)
    assert task["readonlyRootFilesystem"] is False  # the agent edits /testbed in place
    (mount,) = task["mountPoints"]
    assert mount["containerPath"] == task_shape.STATE_DIR and mount["readOnly"] is False
    assert {"name": mount["sourceVolume"]} in td.inputs["volumes"]  # a task volume, not a host path
    assert {"name": "EVALPLANE_STATE_DIR", "value": task_shape.STATE_DIR} in task["environment"]
    assert td.inputs["ephemeralStorage"]["sizeInGib"] >= 30  # a ~1.1 GB instance image extracted, plus the layer
    assert td.inputs["requiresCompatibilities"] == ["FARGATE"] and td.inputs["networkMode"] == "awsvpc"


def test_logs_go_to_the_harness_log_group(estate_snapshot):
    (task,) = _containers(estate_snapshot)
    assert task["logConfiguration"]["logDriver"] == "awslogs"
    assert task["logConfiguration"]["options"]["awslogs-group"] == "/evalplane/harness"


def test_the_template_image_is_a_placeholder_in_the_task_images_repository(estate_snapshot):
    (task,) = _containers(estate_snapshot)
    assert task["image"].startswith(estate_snapshot.outputs["task_images_repository_url"] + ":")


def _as_described(snapshot) -> tuple[dict, list[dict]]:
    """The template as DescribeTaskDefinition returns it: API names and shapes, plus read-only fields."""
    td = _template(snapshot)
    described = {k: v for k, v in td.inputs.items() if k not in ("tags", "ephemeralStorage", "containerDefinitions")}
    described |= {
        "containerDefinitions": json.loads(td.inputs["containerDefinitions"]),
        "ephemeralStorage": {"sizeInGiB": int(td.inputs["ephemeralStorage"]["sizeInGib"])},
        "taskDefinitionArn": td.outputs["arn"], "revision": 1, "status": "ACTIVE",
        "compatibilities": ["EC2", "FARGATE"], "requiresAttributes": [{"name": "ecs.capability.secrets.asm.environment-variables"}],
        "registeredAt": "2025-01-01T00:00:00Z", "registeredBy": "arn:aws:iam::123456789012:role/pulumi",
    }
    return described, [{"key": k, "value": v} for k, v in td.inputs["tags"].items()]


def test_the_launcher_s_revision_differs_from_the_template_only_in_the_image(estate_snapshot):
    described, tags = _as_described(estate_snapshot)
    arn = described["taskDefinitionArn"]
    args = derive_revision(described, tags, task_shape.CONTAINER, DIGEST, arn)

    assert set(args) <= register_fields()
    # every field RegisterTaskDefinition takes is carried over, the read-only ones are not
    assert set(args) - {"tags"} == {k for k in described if k in register_fields()}
    for key in set(args) - {"containerDefinitions", "tags"}:
        assert args[key] == described[key], key
    (derived,), (template,) = args["containerDefinitions"], described["containerDefinitions"]
    assert derived["image"] == DIGEST != template["image"]
    assert {k: v for k, v in derived.items() if k != "image"} == {k: v for k, v in template.items() if k != "image"}
    # the template's tags (the tier tag the dispatcher's IAM grant requires) plus where the revision came from
    assert args["tags"] == tags + [{"key": "evalplane:template", "value": arn},
                                   {"key": "evalplane:image-digest", "value": "sha256:" + "ab" * 32}]
    assert described["containerDefinitions"][0]["image"] == template["image"]  # the template itself is untouched


def test_the_judge_task_has_what_the_judge_command_reads(estate_snapshot, monkeypatch):
    """The judge's container is the one dispatcher.judge.ecs overrides; it holds no gateway or provider key of its
    own: its task role reads a pass's key from the run's judge-key secret (dispatcher.judge.ecs.key_secret_name) and
    no run's gateway key; the database's parts assemble into the URL contract.db connects to."""
    from contract import db
    from dispatcher.judge.ecs import CONTAINER, key_secret_name

    s = estate_snapshot
    td = s.one("aws:ecs/taskDefinition:TaskDefinition", "evalplane-judge-task")
    (judge,) = json.loads(td.inputs["containerDefinitions"])
    assert judge["name"] == CONTAINER
    secrets = {x["name"]: x["valueFrom"] for x in judge["secrets"]}
    assert set(secrets) == {"DATABASE_USERNAME", "DATABASE_PASSWORD", valkey_auth.USER_ENV, valkey_auth.PASSWORD_ENV}
    policies = {r.inputs["name"]: json.loads(r.inputs["policy"]) for r in s.of("aws:iam/rolePolicy:RolePolicy")}
    (readable,) = [st["Resource"] for st in policies["judge-task"]["Statement"]
                   if "secretsmanager:GetSecretValue" in st["Action"]]
    readable = readable if isinstance(readable, list) else [readable]
    outputs = StackOutputs.model_construct(run_secrets_prefix="evalplane/runs/")  # the estate's, as exported
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:"
    assert [fnmatch.fnmatchcase(arn + key_secret_name(outputs, "run-1") + "-AbCdEf", r) for r in readable] == [True]
    assert not fnmatch.fnmatchcase(arn + "evalplane/runs/run-1/gateway-key-AbCdEf", readable[0])
    env = {x["name"]: x["value"] for x in judge["environment"]}
    monkeypatch.delenv("DATABASE_URL", raising=False)
    for k, v in {**env, "DATABASE_USERNAME": "judge", "DATABASE_PASSWORD": "p@ss word"}.items():
        monkeypatch.setenv(k, v)
    url = db.database_url()
    assert f"host={env['DATABASE_HOST']}" in url and f"dbname={env['DATABASE_NAME']}" in url
    assert "user=judge" in url and "password='p@ss word'" in url and "sslmode=require" in url


def test_a_runs_spot_share_names_capacity_providers_its_cluster_has(estate_snapshot):
    """backend.spot reaches RunTask as a capacity provider strategy: every provider it names is one the estate's
    harness cluster has (ClusterCapacityProviders), on that cluster."""
    s = estate_snapshot
    caps = s.one("aws:ecs/clusterCapacityProviders:ClusterCapacityProviders", "evalplane-harness-capacity")
    cluster = s.one("aws:ecs/cluster:Cluster", "evalplane-harness-cluster")
    launcher = EcsLauncher.from_stack_outputs(StackOutputs.model_validate(s.outputs), spot=0.5,
                                              client=boto3.client("ecs", region_name="us-east-1"))
    strategy = launcher.harness.placement()["capacityProviderStrategy"]
    assert {p["capacityProvider"] for p in strategy} == {"FARGATE_SPOT", "FARGATE"} <= set(
        caps.inputs["capacityProviders"])
    assert launcher.harness.cluster == cluster.outputs["arn"] and caps.inputs["clusterName"] == cluster.outputs["name"]
