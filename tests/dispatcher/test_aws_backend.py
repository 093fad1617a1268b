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
    cancel = subprocess.run([sys.executable, "-m", "dispatcher", "cancel", str(spec)], env=env, cwd=root,
                            capture_output=True, text=True, check=False)
    assert cancel.returncode == 0, cancel.stderr
    assert driver.wait(timeout=180) == 0, driver.stderr.read()[-3000:]
    with psycopg.connect(database_url) as conn:
        landed = dict(conn.execute("SELECT instance_id, outcome FROM attempts WHERE run = %s", (unique,)).fetchall())
    assert len(landed) == len(rows)
    assert all(t["lastStatus"] == "STOPPED" for t in ecs.describe_tasks(cluster=outputs.cluster_arn,
                                                                         tasks=harness)["tasks"])
