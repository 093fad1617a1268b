"""The judge on AWS: one Fargate task from the estate's judge task definition (components/control.py), in the
harness subnets under the judge's security group, running `python -m dispatcher judge RUN --here ...` against the
estate's gateway and Valkey (from the stack outputs). The database's credentials come from the task definition; the
pass's own gateway key, minted here (dispatcher/judge/gateway.py), from a secret of the run's
({run_secrets_prefix}{run}/judge-key) that the task reads with its role: no RunTask or DescribeTasks shows it."""

from __future__ import annotations

import os

from contract import aws, task_shape
from dispatcher.backends.stack_outputs import StackOutputs
from dispatcher.judge.rubric import Rubric
from dispatcher.launchers.ecs import EcsTarget, started_by

CONTAINER = "judge"  # the container name in the judge task definition
KEY_SECRET_ENV = "EVALPLANE_JUDGE_KEY_SECRET"  # the ARN of the secret holding the pass's gateway key


def key_secret_name(outputs: StackOutputs, run: str) -> str:
    return f"{outputs.required('run_secrets_prefix')}{run}/{task_shape.JUDGE_KEY_SECRET}"


def pass_key() -> str:
    """In the judge's task: the pass's gateway key, from the secret the dispatcher named."""
    arn = os.environ.get(KEY_SECRET_ENV)
    if not arn:
        raise RuntimeError(f"--alias: the pass's gateway key is read from the secret named by {KEY_SECRET_ENV},"
                           " which is not set")
    return aws.client("secretsmanager").get_secret_value(SecretId=arn)["SecretString"]


def open_pass(stack_outputs: str, run: str, judge_run: str, database_url: str, valkey_url: str, provider: str,
              model: str, provider_url: str, key_name: str, budget_usd: float) -> tuple[str, str]:
    """The pass's place at the estate's gateway: the provider key `key_name` checked in the gateway's store, the
    judge's alias (`model` at `provider_url`) and key minted in the estate's database, the key put in its secret.
    -> (the alias, the secret's ARN)."""
    from dispatcher.backends.aws import put_run_secret, require_provider_key
    from dispatcher.judge.gateway import mint_judge

    outputs = StackOutputs.load(stack_outputs)
    require_provider_key(outputs, key_name, "--api-key-env")
    gw = mint_judge(database_url, valkey_url, judge_run, outputs.gateway_url, f"{model}@judge", provider, model,
                    provider_url, key_name, budget_usd)
    return gw.alias, put_run_secret(outputs, key_secret_name(outputs, run), gw.key, run,
                                    "A judge pass's gateway key (evalplane)")


def launch(stack_outputs: str, run: str, argv: list[str], rubric: Rubric | None = None,
           key_secret_arn: str | None = None) -> str:
    """Start the judge's task; returns its ARN. Raises RuntimeError with ECS's reason when it is not placed. A rubric
    given here goes to the run's bucket, where the task reads it (`--rubric s3://...`); the task finds its gateway
    key in the secret key_secret_arn (open_pass)."""
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
                                           "environment": [{"name": "VALKEY_URL", "value": outputs.valkey_url}] + (
                                               [{"name": KEY_SECRET_ENV, "value": key_secret_arn}]
                                               if key_secret_arn else [])}]},
        tags=[{"key": "evalplane:run", "value": run}, {"key": "evalplane:role", "value": "judge"}])
    if not resp.get("tasks"):
        reasons = "; ".join(f"{f.get('arn', '')}: {f.get('reason', '')}" for f in resp.get("failures", []))
        raise RuntimeError(f"the judge task was not started: {reasons or 'no reason given'}")
    return resp["tasks"][0]["taskArn"]
