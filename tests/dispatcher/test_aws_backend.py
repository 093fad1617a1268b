"""backend = "aws" as the dispatcher drives it, against moto in server mode: the per-run resources and the ECS
launcher come from the Pulumi stack-outputs file exactly as dispatcher/run.py builds them (`resources.ensure` on the
stack's bucket and queue prefix, `EcsLauncher.from_stack_outputs(outputs)` with nothing else: the region and
endpoint from the environment, task-image revisions cached in DATABASE_URL). Eval workers are EC2 RunTasks handed
their run's eval queue; each harness attempt is a Fargate RunTask of its task image's revision carrying only its
job's URI in the stack's bucket; a restarted dispatcher finds them again, and a cancel stops them.
(moto runs no containers: the tasks stay RUNNING until stopped.)

The driver loop's side (job documents, landed rows, the cancel landing every attempt) runs the launcher through
`launch(ref, job_uri, image)`; which task image each attempt gets is the plan's (dispatcher/run.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import boto3
from test_launcher_ecs import add_container_instance, estate, manual_progression, task_image  # noqa: F401 (fixtures)

from contract import task_shape
from contract.models import AttemptRef
from dispatcher import resources
from dispatcher.launchers.ecs import EcsLauncher
from dispatcher.launchers.stack_outputs import StackOutputs

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
