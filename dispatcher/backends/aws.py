"""The AWS backend: the Pulumi estate (backend.stack_outputs). The run's bucket and queues under the estate's
prefix, the estate's Valkey as the dispatcher's user, the verdict key from Secrets Manager, tasks on Fargate through
the ECS launcher, eval workers on the estate's EC2 eval cluster (launched, and their placement retried, by the same
launcher), and task images looked up in the estate's ECR (a build tier builds them; a run never does).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from contract import aws
from contract.signing import RunKeys
from dispatcher.backends.base import Backend, key_folder
from dispatcher.backends.resources import RunResources
from dispatcher.backends.stack_outputs import StackOutputs


class AwsBackend(Backend):
    launchers = ("ecs",)
    builds_images = False
    local_stack = False
    spot_capacity = True  # the estate's harness cluster has the FARGATE_SPOT capacity provider

    @classmethod
    def spec_problem(cls, backend_spec) -> str | None:
        return super().spec_problem(backend_spec) or (
            None if backend_spec.stack_outputs else "stack_outputs is required when kind = 'aws'")

    @functools.cached_property
    def outputs(self) -> StackOutputs:
        return StackOutputs.load(self.spec.backend.stack_outputs)

    def image_target(self):
        """The estate's ECR repository (the build tier pushes there)."""
        from dispatcher.images import Target

        host, _, repo = self.outputs.task_images_repository_url.partition("/")  # <registry>/<repository>
        return Target(host, repo, self.spec.images.instance_registry)

    def image_problems(self, plan) -> dict[str, str]:
        """Each instance's task image recorded, for its current inputs, in the estate's registry."""
        from dispatcher import images, store

        with store.connect() as conn:
            return images.for_plan(plan, conn, build=False)[1]

    def bucket(self) -> str:
        return self.outputs.bucket

    @property
    def queue_prefix(self) -> str:
        return self.outputs.queue_prefix

    def verdict_key_file(self) -> Path:
        """The estate's secret (the eval fleet's task definition holds the same one), copied here for the results
        writers."""
        value = aws.client("secretsmanager").get_secret_value(
            SecretId=self.outputs.required("verdict_key_secret_arn"))["SecretString"]
        path = key_folder() / f"verdict.{self.outputs.region}.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value.strip())
        return path

    def valkey_url(self, given: str) -> str:
        """VALKEY_URL if set, else the estate's Valkey as the dispatcher's own user (its Secrets Manager secret)."""
        return os.environ.get("VALKEY_URL") or self.outputs.dispatcher_valkey_url()

    def upstream(self, plan) -> tuple[str, str]:
        # The provider key reaches tasks from Secrets Manager through their task definition, never from here.
        return self.spec.model.base_url or self.outputs.gateway_url, ""

    def start_eval_workers(self, res: RunResources, run_keys: RunKeys) -> None:
        """On the eval cluster, through the run's ECS launcher (which retries those not placed in retry_pending)."""
        self.launcher.launch_eval_workers(self.spec.eval.workers, run=self.spec.run.name, command=[
            "--queue", res.eval_queue_url, "--backend", self.spec.eval.backend, "--idle-exit", "900"])
