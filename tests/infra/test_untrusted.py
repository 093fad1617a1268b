"""The agent is untrusted (issue 24), in the estate: Valkey needs a user and password (tasks get the harness user's,
from Secrets Manager, as ECS secrets), verdicts come only from the eval role, and the verdict key reaches only the
eval workers and the dispatcher. Checked on the mocked build; the IAM part also against moto's IAM enforcement.
"""

from __future__ import annotations

import fnmatch
import json
import os

import boto3
import pytest
from botocore.exceptions import ClientError

from components.common import EVAL_QUEUES, RESULTS_QUEUES, VERDICT_QUEUES
from components.state import VALKEY_USERS
from contract import signing, valkey_auth
from dispatcher.backends import resources


def _containers(s, family: str) -> list[dict]:
    (td,) = [r for r in s.of("aws:ecs/taskDefinition:TaskDefinition") if r.inputs["family"] == family]
    return json.loads(td.inputs["containerDefinitions"])


SECRET_SIG = "4dabf18193072939515e22adb298388d"  # how Pulumi marks a secret value in resource inputs


def _secret(value):
    """The value of a Pulumi secret input (and a check that it is one: it is encrypted in the stack's state)."""
    assert isinstance(value, dict) and SECRET_SIG in value, value
    return value["value"]


def _policies(s) -> dict[str, dict]:
    return {r.inputs["name"]: json.loads(r.inputs["policy"]) for r in s.of("aws:iam/rolePolicy:RolePolicy")}


def test_valkey_refuses_connections_without_a_user_and_password(estate_snapshot):
    s = estate_snapshot
    (group,) = s.of("aws:elasticache/replicationGroup:ReplicationGroup")
    (users,) = s.of("aws:elasticache/userGroup:UserGroup")
    assert group.inputs["userGroupIds"] == [users.outputs["userGroupId"]]  # RBAC: AUTH with a user on every connection
    assert group.inputs["transitEncryptionEnabled"] is True and group.inputs["transitEncryptionMode"] == "required"
    by_id = {u.inputs["userId"]: u for u in s.of("aws:elasticache/user:User")}
    assert set(users.inputs["userIds"]) == set(by_id)
    (default,) = [u for u in by_id.values() if u.inputs["userName"] == "default"]
    assert default.inputs["accessString"].split()[0] == "off"  # no connection without a named user
    for u in by_id.values():
        mode = _secret(u.inputs["authenticationMode"])
        assert mode["type"] == "password" and len(mode["passwords"][0]) >= 32
    (harness,) = [u for u in by_id.values() if u.inputs["userName"] == "evalplane-harness"]
    assert harness.inputs["accessString"] == "on " + " ".join(valkey_auth.task_rules("*", "*"))
    assert harness.inputs["accessString"] == VALKEY_USERS["harness"]
    assert "-@admin" in harness.inputs["accessString"] and "~*" not in harness.inputs["accessString"].split()


def test_each_valkey_user_secret_holds_that_users_name_and_password(estate_snapshot):
    s = estate_snapshot
    users = {u.inputs["userName"]: u for u in s.of("aws:elasticache/user:User")}
    versions = {v.inputs["secretId"]: json.loads(_secret(v.inputs["secretString"]))
                for v in s.of("aws:secretsmanager/secretVersion:SecretVersion") if v.name.startswith("evalplane-state-valkey")}
    for role in ("dispatcher", "harness", "gateway"):
        secret = s.one("aws:secretsmanager/secret:Secret", f"evalplane-state-valkey-{role}-secret")
        value = versions[secret.id]
        user = users[f"evalplane-{role}"]
        password = _secret(user.inputs["authenticationMode"])["passwords"][0]
        assert value == {"username": f"evalplane-{role}", "password": password}
    assert s.outputs["valkey_dispatcher_secret_arn"] == s.one(
        "aws:secretsmanager/secret:Secret", "evalplane-state-valkey-dispatcher-secret").outputs["arn"]


def test_the_verdict_key_reaches_the_eval_workers_and_the_dispatcher_never_a_task(estate_snapshot):
    s = estate_snapshot
    verdict = s.outputs["verdict_key_secret_arn"]
    (worker,) = _containers(s, "evalplane-eval-worker")
    assert worker["secrets"] == [{"name": signing.VERDICT_KEY_ENV, "valueFrom": verdict}]
    for family in ("evalplane-harness", "evalplane-judge", "evalplane-gateway"):
        for c in _containers(s, family):
            assert verdict not in json.dumps(c), family
            assert signing.VERDICT_KEY_ENV not in json.dumps(c), family
    p = _policies(s)
    readers = {name for name, doc in p.items() for st in doc["Statement"]
               if "secretsmanager:GetSecretValue" in st["Action"] and verdict in st["Resource"]}
    assert readers == {"eval-exec", "dispatcher"}
    harness_user = s.one("aws:secretsmanager/secret:Secret", "evalplane-state-valkey-harness-secret").outputs["arn"]
    (judge,) = _containers(s, "evalplane-judge")
    assert {"name": valkey_auth.PASSWORD_ENV, "valueFrom": f"{harness_user}:password::"} in judge["secrets"]
    (gw,) = _containers(s, "evalplane-gateway")
    gw_user = s.one("aws:secretsmanager/secret:Secret", "evalplane-state-valkey-gateway-secret").outputs["arn"]
    assert {"name": "GATEWAY_VALKEY_PASSWORD", "valueFrom": f"{gw_user}:password::"} in gw["secrets"]


def test_the_queue_patterns_are_the_dispatchers_queue_names():
    run = "some-run-7"
    assert fnmatch.fnmatchcase(resources.verdict_queue_name(run), VERDICT_QUEUES)
    assert fnmatch.fnmatchcase(resources._queue_name(run, "results"), RESULTS_QUEUES)
    assert fnmatch.fnmatchcase(resources._queue_name(run, "eval"), EVAL_QUEUES)
    # no queue of one kind matches another kind's pattern (the DLQs match none: only SQS redrives into them)
    for name in (resources._queue_name(run, k) for k in ("results-dlq", "eval-dlq", "eval", "verdicts")):
        assert not fnmatch.fnmatchcase(name, RESULTS_QUEUES), name
    for name in (resources._queue_name(run, k) for k in ("results", "results-dlq", "eval")):
        assert not fnmatch.fnmatchcase(name, VERDICT_QUEUES), name


@pytest.fixture
def iam_moto():
    """A moto server of its own, whose IAM enforcement the test switches on (moto's setting is process-wide: it
    is switched back off before the test ends)."""
    from moto.server import ThreadedMotoServer

    from tests.conftest import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        yield endpoint
    finally:
        import requests

        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10)
        server.stop()


def _access_denied(e: ClientError) -> bool:
    """moto answers an IAM refusal with 403 (its error code differs by protocol)."""
    return e.response["ResponseMetadata"]["HTTPStatusCode"] == 403 and "AccessDenied" in str(e.response)


def _client(service: str, endpoint: str, creds: dict | None = None):
    creds = creds or {"AccessKeyId": "testing", "SecretAccessKey": "testing"}
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                        aws_session_token=creds.get("SessionToken"))


def test_a_task_role_cannot_send_a_verdict_and_only_the_eval_role_can(estate_snapshot, iam_moto, monkeypatch):
    """The estate's own role policies (as the mocked build made them) on moto with IAM enforced: a harness task's
    credentials can send to its run's results queue but are refused on the verdict queue; the eval role's can send
    verdicts and nothing to the results queue."""
    import requests

    for k in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    p = _policies(estate_snapshot)
    sqs, iam, sts = (_client(x, iam_moto) for x in ("sqs", "iam", "sts"))
    run = "iam-check"
    url = {kind: sqs.create_queue(QueueName="evalplane-" + name)["QueueUrl"] for kind, name in (
        ("results", resources._queue_name(run, "results")), ("eval", resources._queue_name(run, "eval")),
        ("verdicts", resources.verdict_queue_name(run)))}
    creds = {}
    for role in ("harness-task", "eval-task"):
        arn = iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                   "Principal": {"Service": "ecs-tasks.amazonaws.com"}}]}))["Role"]["Arn"]
        iam.put_role_policy(RoleName=role, PolicyName=role, PolicyDocument=json.dumps(p[role]))
        creds[role] = sts.assume_role(RoleArn=arn, RoleSessionName=f"{role}-{os.getpid()}")["Credentials"]
    # from here on every request is authenticated and checked against its caller's policies
    requests.post(f"{iam_moto}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
    task, worker = _client("sqs", iam_moto, creds["harness-task"]), _client("sqs", iam_moto, creds["eval-task"])

    task.send_message(QueueUrl=url["results"], MessageBody="a result")  # its own kind of message: allowed
    with pytest.raises(ClientError) as denied:
        task.send_message(QueueUrl=url["verdicts"], MessageBody='{"msg": {"kind": "verdict"}}')
    assert _access_denied(denied.value)
    with pytest.raises(ClientError):
        task.receive_message(QueueUrl=url["eval"])  # nor read the eval jobs

    worker.send_message(QueueUrl=url["verdicts"], MessageBody="a verdict")
    with pytest.raises(ClientError) as denied:
        worker.send_message(QueueUrl=url["results"], MessageBody="a forged result")
    assert _access_denied(denied.value)
    worker.receive_message(QueueUrl=url["eval"], WaitTimeSeconds=0)
    with pytest.raises(ClientError):
        _client("sqs", iam_moto, {"AccessKeyId": "AKIAUNKNOWN000000000", "SecretAccessKey": "x"}).send_message(
            QueueUrl=url["verdicts"], MessageBody="no credentials at all")


def test_a_task_image_revision_keeps_the_templates_secrets_and_nothing_else_changes(estate_snapshot):
    """The dispatcher registers one revision per task image from the template (task_definitions.derive_revision):
    the Valkey user stays an ECS secret, the run's key secret is added as one, no secret value appears, only the
    image and the run's secret change."""
    from dispatcher.launchers.task_definitions import derive_revision

    (td,) = [r for r in estate_snapshot.of("aws:ecs/taskDefinition:TaskDefinition")
             if r.inputs["family"] == "evalplane-harness"]
    template = {"family": "evalplane-harness", "containerDefinitions": json.loads(td.inputs["containerDefinitions"]),
                "taskRoleArn": "arn:role/task", "executionRoleArn": "arn:role/exec"}
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/evalplane/task-images@sha256:" + "a" * 64
    run_key = "arn:aws:secretsmanager:us-east-1:123456789012:secret:evalplane/runs/r1/gateway-key-AbCdEf"
    (derived,) = derive_revision(template, [], "task", image, "arn:template",
                                 {"EVALPLANE_UPSTREAM_KEY": run_key})["containerDefinitions"]
    (original,) = template["containerDefinitions"]
    assert derived == original | {"image": image, "secrets": [
        *original["secrets"], {"name": "EVALPLANE_UPSTREAM_KEY", "valueFrom": run_key}]}
    assert {s["name"] for s in derived["secrets"]} == {"EVALPLANE_UPSTREAM_KEY", valkey_auth.USER_ENV,
                                                      valkey_auth.PASSWORD_ENV}
    assert signing.ATTEMPT_KEY_ENV not in json.dumps(derived)  # per attempt, in RunTask's override only
