"""backend = "aws" end to end against moto in server mode: the run is built from the Pulumi stack outputs,
job documents go to the stack's bucket, harness tasks are Fargate RunTasks carrying only their job URI,
eval workers are EC2 RunTasks handed their run's eval queue, and a cancelled run still lands every attempt.
(moto runs no containers: the tasks stay RUNNING until the cancel stops them.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import boto3
import psycopg

from test_launcher_ecs import add_container_instance, estate, manual_progression  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"


def test_aws_backend_runs_from_stack_outputs(estate, tmp_path, database_url, valkey_url, moto_endpoint,  # noqa: F811
                                             unique):
    outputs = json.loads(estate.read_text())
    boto3.client("s3").create_bucket(Bucket=outputs["bucket"])
    add_container_instance(outputs["eval_cluster_arn"], "m5.2xlarge")
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
[eval]
backend = "docker"
workers = 2
""")
    env = {"PATH": "/usr/bin:/bin", "DATABASE_URL": database_url, "VALKEY_URL": valkey_url,
           "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "EVALPLANE_STATE_DIR": str(tmp_path / "state"),
           "RAY_USAGE_STATS_ENABLED": "0", "HOME": str(tmp_path)}
    driver = subprocess.Popen([sys.executable, "-m", "dispatcher", "run", str(spec)], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ecs = boto3.client("ecs")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        harness = ecs.list_tasks(cluster=outputs["cluster_arn"], startedBy=f"evalplane/{unique}")["taskArns"]
        if len(harness) >= 2:
            break
        assert driver.poll() is None, driver.stderr.read()[-3000:]
        time.sleep(0.5)
    tasks = ecs.describe_tasks(cluster=outputs["cluster_arn"], tasks=harness)["tasks"]
    assert len(tasks) == 2  # the planner's first target, within backend.concurrency
    bucket = outputs["bucket"]
    for t in tasks:
        (override,) = t["overrides"]["containerOverrides"]
        assert override["name"] == "harness" and len(override["command"]) == 1
        job_uri = override["command"][0]
        assert job_uri.startswith(f"s3://{bucket}/runs/{unique}/jobs/")  # only the job reference
        key = job_uri.removeprefix(f"s3://{bucket}/")
        job = json.loads(boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
        assert job["upstream_url"] == outputs["gateway_url"]
        assert "key" not in json.dumps(job["harness"]).lower() and "sk-" not in json.dumps(job)
    workers = ecs.describe_tasks(cluster=outputs["eval_cluster_arn"], tasks=ecs.list_tasks(
        cluster=outputs["eval_cluster_arn"], startedBy="evalplane/eval-worker")["taskArns"])["tasks"]
    assert len(workers) == 2
    command = workers[0]["overrides"]["containerOverrides"][0]["command"]
    assert command[0] == "--queue" and "evalplane-ep-" in command[1] and command[1].endswith("-eval")

    cancel = subprocess.run([sys.executable, "-m", "dispatcher", "cancel", str(spec)], env=env, cwd=ROOT,
                            capture_output=True, text=True)
    assert cancel.returncode == 0, cancel.stderr
    assert driver.wait(timeout=180) == 0, driver.stderr.read()[-3000:]
    with psycopg.connect(database_url) as conn:
        rows = dict(conn.execute("SELECT instance_id, outcome FROM attempts WHERE run = %s", (unique,)).fetchall())
        status = conn.execute("SELECT status FROM runs WHERE run = %s", (unique,)).fetchone()[0]
    assert len(rows) == 5 and status == "cancelled"
    assert sorted(rows.values()).count("cancelled") >= 3  # never launched
    stopped = ecs.describe_tasks(cluster=outputs["cluster_arn"], tasks=harness)["tasks"]
    assert all(t["lastStatus"] == "STOPPED" for t in stopped)
