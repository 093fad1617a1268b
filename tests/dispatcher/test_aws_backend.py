"""backend = "aws" as the dispatcher drives it, against moto in server mode: the per-run resources and the ECS
launcher come from the Pulumi stack-outputs file exactly as dispatcher/driver/loop.py builds them (`resources.ensure` on the
stack's bucket and queue prefix, `EcsLauncher.from_stack_outputs(outputs)` with nothing else: the region and
endpoint from the environment, task-image revisions cached in DATABASE_URL). Eval workers are EC2 RunTasks handed
their run's eval queue; each harness attempt is a Fargate RunTask of its task image's revision carrying only its
job's URI in the stack's bucket; a restarted dispatcher finds them again, and a cancel stops them.
(moto runs no containers: the tasks stay RUNNING until stopped.)

The driver loop's side (job documents, landed rows, the cancel landing every attempt) runs the launcher through
`launch(ref, job_uri, image)`; which task image each attempt gets is the plan's (dispatcher/driver/loop.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import boto3
from test_launcher_ecs import add_container_instance, estate, manual_progression, task_image  # noqa: F401 (fixtures)

from contract import task_shape
from contract.models import AttemptRef
from dispatcher.backends import resources
from dispatcher.backends.stack_outputs import StackOutputs
from dispatcher.launchers.ecs import EcsLauncher

SYNTHETIC = Path(__file__).resolve().parents[2] / "examples" / "synthetic"


def test_aws_backend_launches_from_stack_outputs(estate, database_url, moto_endpoint, unique):  # noqa: F811
    outputs = StackOutputs.load(estate)
    add_container_instance(outputs.eval_cluster_arn, "m5.2xlarge")
    res = resources.ensure(unique, bucket=outputs.bucket, queue_prefix=outputs.queue_prefix)
    launcher = EcsLauncher.from_stack_outputs(outputs)  # as run.py calls it

    workers = launcher.launch_eval_workers(2, run=unique, command=["--queue", res.eval_queue_url, "--backend", "docker"])
    ecs = boto3.client("ecs")
    described = ecs.describe_tasks(cluster=outputs.eval_cluster_arn, tasks=workers)["tasks"]
    assert len(described) == 2
    for t in described:
        command = t["overrides"]["containerOverrides"][0]["command"]
        assert command[:2] == ["--queue", res.eval_queue_url] and res.eval_queue_url.endswith("-eval")

    ids = [json.loads(line)["instance_id"] for line in (SYNTHETIC / "instances.jsonl").read_text().splitlines()][:3]
    refs = [AttemptRef(run=unique, instance_id=i, attempt=1) for i in ids]
    images = {r: task_image(f"{unique}/{r.instance_id}") for r in refs}
    handles = launcher.launch_many([(r, res.job_uri(r), images[r]) for r in refs])
    tasks = {t["taskArn"]: t for t in ecs.describe_tasks(cluster=outputs.cluster_arn,
                                                         tasks=[h.task_id for h in handles])["tasks"]}
    for h in handles:
        t = tasks[h.task_id]
        (override,) = t["overrides"]["containerOverrides"]
        assert override == {"name": task_shape.CONTAINER, "command": [res.job_uri(h.ref)]}  # only the job reference
        assert override["command"][0].startswith(f"s3://{outputs.bucket}/runs/{unique}/jobs/")
        assert t["taskDefinitionArn"] == launcher.revisions.arn(images[h.ref]) != outputs.harness_task_definition_arn
        assert t["containers"][0]["image"] == images[h.ref]
    assert launcher.revisions.registered == 3

    # a restarted dispatcher (a new launcher from the same file) finds the run's tasks and reuses the revisions
    again = EcsLauncher.from_stack_outputs(outputs)
    found = again.find_running(unique)
    assert {h.ref: h.task_id for h in found} == {h.ref: h.task_id for h in handles}
    assert [again.revisions.arn(images[r]) for r in refs] == [launcher.revisions.arn(images[r]) for r in refs]
    assert again.revisions.registered == 0

    for h in found:  # cancel: every task is stopped, and reads as exited
        again.stop(h)
    again.refresh()
    assert all(again.poll(h) is not None for h in found)
    stopped = ecs.describe_tasks(cluster=outputs.cluster_arn, tasks=[h.task_id for h in handles])["tasks"]
    assert all(t["lastStatus"] == "STOPPED" for t in stopped)
    resources.remove_queues(res)


def test_each_runtask_carries_its_own_attempts_key_and_nothing_else(estate, database_url, moto_endpoint, unique,  # noqa: F811
                                                                    run_keys):
    """As run.py launches on AWS: the command override is the job's URI, the environment override only that
    attempt's signing key (its other secrets come from the task definition)."""
    from contract import signing
    from dispatcher.backends.base import attempt_env

    outputs = StackOutputs.load(estate)
    launcher = EcsLauncher.from_stack_outputs(outputs, attempt_env=attempt_env(run_keys))
    refs = [AttemptRef(run=unique, instance_id=f"evalplane__calc-{i}", attempt=1) for i in (1, 2)]
    handles = launcher.launch_many([(r, f"s3://{outputs.bucket}/runs/{unique}/jobs/{r.instance_id}/1.json",
                                     task_image(f"{unique}/{r.instance_id}")) for r in refs])
    tasks = boto3.client("ecs").describe_tasks(cluster=outputs.cluster_arn, tasks=[h.task_id for h in handles])["tasks"]
    keys = {}
    for h in handles:
        (t,) = [t for t in tasks if t["taskArn"] == h.task_id]
        (override,) = t["overrides"]["containerOverrides"]
        (env,) = override["environment"]
        assert env["name"] == signing.ATTEMPT_KEY_ENV
        keys[h.ref] = env["value"]
    assert keys == {r: run_keys.attempt_key(r).decode() for r in refs} and len(set(keys.values())) == 2


MIRROR = "mirror.example.invalid:5000"


def build_tier_records(conn, outputs: StackOutputs, rows: list[dict]) -> dict[str, str]:
    """What the build tier leaves behind for a run (eval_worker mirror + `python -m dispatcher images` on the
    estate): each instance image mirrored by digest, each task image recorded for its inputs in the estate's ECR."""
    from dispatcher import images
    from eval_worker.records import MirrorRecord, record_mirror

    registry, _, _repository = outputs.task_images_repository_url.partition("/")
    runtime = images.Runtime(tag="", image_id="", inputs=images.runtime_inputs("mini-swe-agent"), built=False)
    refs = {}
    for row in rows:
        digest = "sha256:" + hashlib.sha256(row["instance_id"].encode()).hexdigest()
        m = MirrorRecord(image=row["image"], registry=MIRROR, repository=f"{MIRROR}/{row['image'].split(':')[0]}",
                         digest=digest, image_id=digest)
        record_mirror(conn, m)
        ref = task_image(row["instance_id"])
        images.record(conn, images.TaskImage(
            row["instance_id"], "mini-swe-agent", images.task_inputs(runtime, m.ref, row), registry, ref, digest,
            m.ref, "sha256:runtime", 1, 1, 1.0))
        refs[row["instance_id"]] = ref
    return refs


def test_aws_driver_runs_each_attempt_in_its_recorded_task_image(estate, tmp_path, database_url, valkey_url,  # noqa: F811
                                                                 moto_endpoint, unique):
    """`python -m dispatcher run` with backend aws: the plan takes each instance's task image from the build tier's
    records (never building), harness tasks are RunTasks of that image's revision carrying only their job URI, eval
    workers get their run's queue, and a cancel still lands every attempt. An instance without a recorded task image
    is refused before anything is written."""
    import subprocess
    import sys
    import time

    import psycopg

    outputs = StackOutputs.load(estate)
    boto3.client("s3").create_bucket(Bucket=outputs.bucket)
    add_container_instance(outputs.eval_cluster_arn, "m5.2xlarge")
    rows = [json.loads(line) for line in (SYNTHETIC / "instances.jsonl").read_text().splitlines()]
    spec = tmp_path / "spec.toml"
    spec.write_text(f"""
[run]
name = "{unique}"
[harness]
name = "mini-swe-agent"
[model]
provider = "anthropic"
model = "claude-sonnet-4-5"
base_url = "https://provider.example.invalid"
api_key_env = "ANTHROPIC_API_KEY"
[instances]
dataset = "{SYNTHETIC / 'instances.jsonl'}"
[budget]
run_usd = 5
[backend]
kind = "aws"
stack_outputs = "{estate}"
concurrency = 2
[images]
instance_registry = "{MIRROR}"
[eval]
workers = 2
[gateway]
""")
    env = {"PATH": "/usr/bin:/bin", "DATABASE_URL": database_url, "VALKEY_URL": valkey_url,
           "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "EVALPLANE_STATE_DIR": str(tmp_path / "state"),
           "RAY_USAGE_STATS_ENABLED": "0", "HOME": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    refused = subprocess.run([sys.executable, "-m", "dispatcher", "run", str(spec)], env=env, cwd=root,
                             capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode == 2 and "not mirrored to" in refused.stderr, refused.stderr[-2000:]
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM runs WHERE run = %s", (unique,)).fetchone()[0] == 0
        refs = build_tier_records(conn, outputs, rows)

    driver = subprocess.Popen([sys.executable, "-m", "dispatcher", "run", str(spec)], env=env, cwd=root,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ecs = boto3.client("ecs")
    deadline = time.monotonic() + 180
    harness: list[str] = []
    while time.monotonic() < deadline:
        harness = ecs.list_tasks(cluster=outputs.cluster_arn, startedBy=f"evalplane/{unique}")["taskArns"]
        if len(harness) >= 2:
            break
        assert driver.poll() is None, driver.stderr.read()[-3000:]
        time.sleep(0.5)
    tasks = ecs.describe_tasks(cluster=outputs.cluster_arn, tasks=harness)["tasks"]
    assert len(tasks) == 2  # the planner's first target, within backend.concurrency
    for t in tasks:
        (override,) = t["overrides"]["containerOverrides"]
        assert override["name"] == task_shape.CONTAINER and len(override["command"]) == 1
        key = override["command"][0].removeprefix(f"s3://{outputs.bucket}/")
        job = json.loads(boto3.client("s3").get_object(Bucket=outputs.bucket, Key=key)["Body"].read())
        assert job["repo_source"] == task_shape.TESTBED and job["upstream_url"] == outputs.gateway_url
        assert "sk-" not in json.dumps(job)
        assert t["containers"][0]["image"] == refs[job["ref"]["instance_id"]]  # its own task image, by digest
        # its run's gateway key reaches it as an ECS secret of its revision: the run's own secret
        (container,) = ecs.describe_task_definition(taskDefinition=t["taskDefinitionArn"])["taskDefinition"][
            "containerDefinitions"]
        (key,) = [x for x in container["secrets"] if x["name"] == task_shape.UPSTREAM_KEY_ENV]
        assert f":secret:{unique}/runs/{unique}/gateway-key" in key["valueFrom"]
    cancel = subprocess.run([sys.executable, "-m", "dispatcher", "cancel", str(spec)], env=env, cwd=root,
                            capture_output=True, text=True, check=False)
    assert cancel.returncode == 0, cancel.stderr
    assert driver.wait(timeout=180) == 0, driver.stderr.read()[-3000:]
    with psycopg.connect(database_url) as conn:
        landed = dict(conn.execute("SELECT instance_id, outcome FROM attempts WHERE run = %s", (unique,)).fetchall())
    assert len(landed) == len(rows)
    assert all(t["lastStatus"] == "STOPPED" for t in ecs.describe_tasks(cluster=outputs.cluster_arn,
                                                                         tasks=harness)["tasks"])
    sm = boto3.client("secretsmanager")  # the run ended: its key's secret is gone, its key revoked
    assert not sm.list_secrets(Filters=[{"Key": "name", "Values": [f"{unique}/runs/{unique}/"]}])["SecretList"]
    role = json.loads(sm.get_secret_value(SecretId=outputs.gateway_database_secret_arn)["SecretString"])["username"]
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT revoked_at IS NOT NULL FROM gateway_keys WHERE owner = %s",
                            (unique,)).fetchone() == (True,)
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


def _gateway_spec(tmp_path, outputs_file, run: str, gateway: str = "", **model) -> object:
    from dispatcher.spec import load_spec

    model.setdefault("base_url", "https://provider.example.invalid")
    extra = "".join(f'{k} = "{v}"\n' for k, v in model.items())
    path = tmp_path / "spec.toml"
    path.write_text(f"""
[run]
name = "{run}"
[harness]
name = "mini-swe-agent"
[model]
provider = "anthropic"
model = "claude-sonnet-4-5"
{extra}
[instances]
dataset = "{SYNTHETIC / 'instances.jsonl'}"
[budget]
run_usd = 5
[backend]
kind = "aws"
stack_outputs = "{outputs_file}"
[images]
instance_registry = "{MIRROR}"
[gateway]
{gateway}
""")
    return load_spec(path)


def _replica_url(database_url: str, user: str, password: str) -> str:
    from urllib.parse import quote, urlsplit, urlunsplit

    u = urlsplit(database_url)
    return urlunsplit((u.scheme, f"{quote(user)}:{quote(password)}@{u.hostname}:{u.port}", u.path, u.query, ""))


def _as_replica(settings, api_key: str):
    """What a gateway replica's auth hook sees for api_key (gateway/runtime.py's Runtime.key), and the meter's
    INSERT of one row under the replica's role."""
    import asyncio

    from gateway.runtime import Runtime

    async def go():
        rt = Runtime(settings)
        try:
            return await rt.key(api_key)
        finally:
            await rt.valkey.aclose()
            if rt._db is not None:
                await rt._db.close()
    return asyncio.run(go())


def test_open_gateway_puts_the_runs_key_in_a_secret_its_task_definitions_name(
        estate, tmp_path, database_url, valkey_url, moto_endpoint, unique, run_keys):  # noqa: F811
    """backend aws, [gateway]: open_gateway mints the run's key (hashed, in gateway_keys), registers the pool's alias
    with the operator's provider key by name, makes the replicas' database role, and puts the key in the run's own
    secret; the launcher's revisions name that secret (RunTask's overrides and DescribeTasks never show the key).
    close_gateway revokes the key (a replica refuses it) and deletes the secret; twice is harmless."""
    import psycopg
    import pytest
    import redis
    from botocore.exceptions import ClientError

    from contract import keys as vkeys
    from dispatcher.backends.aws import AwsBackend
    from gateway import aliases, keys
    from gateway.config import GatewaySettings

    spec = _gateway_spec(tmp_path, estate, unique, api_key_env="ANTHROPIC_API_KEY")
    backend = AwsBackend(spec)
    outputs = backend.outputs
    sm, ecs = boto3.client("secretsmanager"), boto3.client("ecs")
    valkey = redis.Redis.from_url(valkey_url)
    role = json.loads(sm.get_secret_value(SecretId=outputs.gateway_database_secret_arn)["SecretString"])
    settings = GatewaySettings(database_url=_replica_url(database_url, role["username"], role["password"]),
                               valkey_url=valkey_url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        try:
            gw = backend.open_gateway(None, conn, valkey_url, run_keys, *backend.upstream(None))
            assert gw.url == outputs.gateway_url and gw.alias == spec.pool
            (owner, scope, budget, revoked) = conn.execute(
                "SELECT owner, aliases, budget_usd, revoked_at FROM gateway_keys WHERE key_hash = %s",
                (keys.key_hash(gw.key),)).fetchone()
            assert (owner, scope, float(budget), revoked) == (unique, [spec.pool], 5.0, None)
            assert conn.execute("SELECT count(*) FROM gateway_keys WHERE key_hash = %s", (gw.key,)).fetchone()[0] == 0
            (d,) = aliases.load(conn, spec.pool)  # the operator's key by its name, never the key
            assert (d.model, d.api_base, d.key_name) == ("anthropic/claude-sonnet-4-5",
                                                         "https://provider.example.invalid", "ANTHROPIC_API_KEY")
            secret = sm.describe_secret(SecretId=f"{unique}/runs/{unique}/gateway-key")
            assert sm.get_secret_value(SecretId=secret["ARN"])["SecretString"] == gw.key
            assert backend.task_secrets == {task_shape.UPSTREAM_KEY_ENV: secret["ARN"]}

            # the replicas' own role reads the key (and nothing of the provider's is in the database)
            valkey.delete(vkeys.gateway_key(keys.key_hash(gw.key)))  # the hook's PostgreSQL path, as the role
            rec = _as_replica(settings, gw.key)
            assert rec is not None and rec.owner == unique and rec.aliases == [spec.pool]

            launcher = EcsLauncher.from_stack_outputs(outputs, secrets=backend.task_secrets)
            ref = AttemptRef(run=unique, instance_id="evalplane__calc-1", attempt=1)
            image = task_image(f"{unique}/calc-1")
            handle = launcher.launch(ref, f"s3://{outputs.bucket}/runs/{unique}/jobs/calc-1/1.json", image)
            revision = ecs.describe_task_definition(taskDefinition=launcher.revisions.arn(image))["taskDefinition"]
            (container,) = revision["containerDefinitions"]
            assert {"name": task_shape.UPSTREAM_KEY_ENV, "valueFrom": secret["ARN"]} in container["secrets"]
            assert task_shape.UPSTREAM_KEY_ENV not in {e["name"] for e in container.get("environment", [])}
            (task,) = ecs.describe_tasks(cluster=outputs.cluster_arn, tasks=[handle.task_id])["tasks"]
            assert gw.key not in json.dumps(revision, default=str) + json.dumps(task, default=str)
            # another run's revisions of the same image are its own (a revision names one run's secret)
            other = EcsLauncher.from_stack_outputs(outputs, secrets={task_shape.UPSTREAM_KEY_ENV: "arn:other"})
            assert other.revisions.arn(image) != launcher.revisions.arn(image)
            launcher.stop(handle)
            backend.close_gateway(conn, valkey)
            assert _as_replica(settings, gw.key) is None  # refused by every replica from now on
            assert keys.from_database(conn, keys.key_hash(gw.key)) is None
            with pytest.raises(ClientError) as gone:
                sm.describe_secret(SecretId=f"{unique}/runs/{unique}/gateway-key")
            assert gone.value.response["Error"]["Code"] == "ResourceNotFoundException"
            backend.close_gateway(conn, valkey)  # the driver's finally calls it again: harmless
        finally:
            backend.close_gateway(conn, valkey)
            conn.execute(f'DROP OWNED BY "{role["username"]}"')
            conn.execute(f'DROP ROLE IF EXISTS "{role["username"]}"')


def test_open_gateway_refuses_what_the_estate_cannot_serve(estate, tmp_path, database_url, valkey_url,  # noqa: F811
                                                           moto_endpoint, unique, run_keys):
    """A provider key the estate's gateway does not hold, or no provider endpoint: an error naming the field,
    before any key is minted."""
    import psycopg
    import pytest

    from dispatcher.backends.aws import AwsBackend

    with psycopg.connect(database_url) as conn:
        backend = AwsBackend(_gateway_spec(tmp_path, estate, unique, api_key_env="MISTRAL_API_KEY"))
        with pytest.raises(RuntimeError, match=r"model.api_key_env: .*'MISTRAL_API_KEY'"):
            backend.open_gateway(None, conn, valkey_url, run_keys, "", "")
        assert conn.execute("SELECT count(*) FROM gateway_keys WHERE owner = %s", (unique,)).fetchone()[0] == 0
        assert backend.task_secrets == {}
        without = AwsBackend(backend.spec.model_copy(update={"gateway": None}))  # tasks would hold no credential
        with pytest.raises(RuntimeError, match=r"^gateway: .*add a \[gateway\] table"):
            without.upstream(None)
        no_endpoint = AwsBackend(backend.spec.model_copy(update={"model": backend.spec.model.model_copy(
            update={"base_url": None, "api_key_env": "ANTHROPIC_API_KEY"})}))
        with pytest.raises(RuntimeError, match=r"^model.base_url: "):
            no_endpoint.open_gateway(None, conn, valkey_url, run_keys, "", "")


def test_a_runs_own_provider_key_is_put_where_only_the_gateway_reads_it(
        estate, tmp_path, database_url, valkey_url, moto_endpoint, unique, run_keys, monkeypatch):  # noqa: F811
    """[gateway] provider_keys: the run's provider key is minted with the run's cap as its limit (with the account's
    key from model.api_key_env on the dispatcher's host) and put in the gateway's Secrets Manager store, which its
    replicas read by the deployment's key name; the gateway key then carries no budget. At close the provider key is
    revoked (the provider refuses it) and removed from the store."""
    import httpx
    import psycopg
    import redis

    from dispatcher import store as records
    from dispatcher.backends.aws import AwsBackend
    from gateway import aliases, keys
    from simulator import SimulatorConfig
    from simulator.testing import running_simulator

    def call(url: str, key: str) -> int:
        return httpx.post(f"{url}/v1/messages", headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                          json={"model": "claude-sonnet-4-5", "max_tokens": 8,
                                "messages": [{"role": "user", "content": "hi"}]}, timeout=30).status_code

    monkeypatch.setenv("SIM_ACCOUNT_KEY", "sk-sim-account")
    sm = boto3.client("secretsmanager")
    with running_simulator(SimulatorConfig(api_key="sk-sim-account")) as url, \
            psycopg.connect(database_url, autocommit=True) as conn:
        backend = AwsBackend(_gateway_spec(tmp_path, estate, unique, gateway='provider_keys = "simulator"',
                                           base_url=url, api_key_env="SIM_ACCOUNT_KEY"))
        role = json.loads(sm.get_secret_value(SecretId=backend.outputs.gateway_database_secret_arn)["SecretString"])
        try:
            gw = backend.open_gateway(None, conn, valkey_url, run_keys, *backend.upstream(None))
            (d,) = aliases.load(conn, backend.spec.pool)
            row = records.provider_key(conn, unique)
            assert d.key_name == row.key_name != "SIM_ACCOUNT_KEY" and row.limit_usd == 5.0
            minted = backend.key_store().get(d.key_name)  # what a replica reads for the deployment
            assert minted and minted != "sk-sim-account" and call(url, minted) == 200
            assert sm.describe_secret(SecretId=f"{unique}/gateway/provider-keys/{d.key_name}")["Name"]
            assert keys.from_database(conn, keys.key_hash(gw.key)).budget_usd is None  # the provider holds the cap
            backend.close_gateway(conn, redis.Redis.from_url(valkey_url))
            assert call(url, minted) == 401  # revoked at the provider
            assert records.provider_key(conn, unique).revoked_at is not None
            assert backend.key_store().get(d.key_name) is None
        finally:
            backend.close_gateway(conn, redis.Redis.from_url(valkey_url))
            conn.execute(f'DROP OWNED BY "{role["username"]}"')
            conn.execute(f'DROP ROLE IF EXISTS "{role["username"]}"')


def test_a_run_raises_the_gateway_service_to_the_replicas_its_forecast_sized(
        estate, tmp_path, database_url, moto_endpoint, unique):  # noqa: F811
    """open_gateway's scaling (AwsBackend.scale_gateway): the estate's gateway service goes up to the replicas the
    run's kept forecast sized, and never down (other runs share the tier); without a forecast it is left alone."""
    import psycopg
    from test_forecast import made

    from dispatcher import forecast
    from dispatcher.backends.aws import AwsBackend
    from dispatcher.driver.fleet import GatewaySizing

    ecs = boto3.client("ecs")
    outputs = json.loads(estate.read_text())
    cluster = ecs.create_cluster(clusterName=f"{unique}-gateway")["cluster"]["clusterArn"]
    ecs.create_service(cluster=cluster, serviceName=f"{unique}-gateway", desiredCount=2,
                       taskDefinition=outputs["harness_task_definition_arn"])
    estate.write_text(json.dumps(outputs | {"gateway_cluster_name": f"{unique}-gateway",
                                            "gateway_service_name": f"{unique}-gateway"}))
    backend = AwsBackend(_gateway_spec(tmp_path, estate, unique))

    def desired() -> int:
        return ecs.describe_services(cluster=cluster, services=[f"{unique}-gateway"])["services"][0]["desiredCount"]

    def keep(replicas: int) -> None:
        forecast.record(conn, unique, made(600, 1.0, 0.1, 0.1).model_copy(update={"gateway": GatewaySizing(
            calls_per_s=replicas * 20.0, replica_calls_per_s=40.0, replicas=replicas)}))

    with psycopg.connect(database_url) as conn:
        assert backend.scale_gateway(conn) is None and desired() == 2  # no forecast kept: left alone
        keep(5)
        assert backend.scale_gateway(conn) == 5 and desired() == 5
        keep(3)
        assert backend.scale_gateway(conn) == 5 and desired() == 5  # another run's replicas are not taken away
