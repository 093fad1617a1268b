"""The judge on AWS: one Fargate task from the estate's judge task definition (components/control.py), in the
harness subnets under the judge's security group, running `python -m dispatcher judge RUN --here ...` against the
estate's gateway and Valkey (from the stack outputs). Its secrets (the database's credentials, the judge's key) come
from the task definition, never through here."""

from __future__ import annotations

from contract import aws
from dispatcher.backends.stack_outputs import StackOutputs
from dispatcher.judge.rubric import Rubric
from dispatcher.launchers.ecs import EcsTarget, started_by

CONTAINER = "judge"  # the container name in the judge task definition


def launch(stack_outputs: str, run: str, argv: list[str], rubric: Rubric | None = None) -> str:
    """Start the judge's task; returns its ARN. Raises RuntimeError with ECS's reason when it is not placed. A rubric
    given here goes to the run's bucket, where the task reads it (`--rubric s3://...`)."""
    outputs = StackOutputs.load(stack_outputs)
    if rubric is not None:
        uri = f"s3://{outputs.bucket}/{outputs.runs_prefix}{run}/judge/rubrics/{rubric.sha}.toml"
        aws.put_text(uri, rubric.to_toml(), "application/toml")
        i = argv.index("--rubric")
        argv = [*argv[:i], "--rubric", uri, *argv[i + 2:]]
    target = EcsTarget(cluster=outputs.cluster_arn, task_definition=outputs.judge_task_definition_arn,
                       container=CONTAINER, subnets=tuple(outputs.harness_subnet_ids),
                       security_groups=(outputs.judge_security_group_id,))
    if "--base-url" not in argv:
        argv = [*argv, "--base-url", outputs.gateway_url]
    resp = aws.client("ecs").run_task(
        cluster=target.cluster, taskDefinition=target.task_definition, launchType=target.launch_type, count=1,
        startedBy=started_by(run + ".judge"), **target.network(),
        overrides={"containerOverrides": [{"name": CONTAINER, "command": ["python", "-m", "dispatcher", *argv],
                                           "environment": [{"name": "VALKEY_URL", "value": outputs.valkey_url}]}]},
        tags=[{"key": "evalplane:run", "value": run}, {"key": "evalplane:role", "value": "judge"}])
    if not resp.get("tasks"):
        reasons = "; ".join(f"{f.get('arn', '')}: {f.get('reason', '')}" for f in resp.get("failures", []))
        raise RuntimeError(f"the judge task was not started: {reasons or 'no reason given'}")
    return resp["tasks"][0]["taskArn"]
