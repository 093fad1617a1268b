"""The AWS backend: the Pulumi estate (backend.stack_outputs). The run's bucket and queues under the estate's
prefix, the estate's Valkey as the dispatcher's user, the verdict key from Secrets Manager, tasks on Fargate through
the ECS launcher, eval workers on the estate's EC2 eval cluster (launched, and their placement retried, by the same
launcher), and task images looked up in the estate's ECR (a build tier builds them; a run never does).

With [gateway], the estate's gateway service (components/gateway.py) is the tier: the run's key is minted in the
estate's database and put in a secret of the run's own ({prefix}/runs/{run}/gateway-key), which the run's task
definitions name (dispatcher/launchers/ecs.py): a task holds that key alone, and no RunTask or DescribeTasks shows it.
The provider keys stay in the gateway's Secrets Manager store (gateway/keyfile.py), which only its replicas read.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

from contract import aws, task_shape
from contract.signing import RunKeys
from dispatcher.backends.base import Backend, key_folder
from dispatcher.backends.resources import RunResources
from dispatcher.backends.stack_outputs import StackOutputs

log = logging.getLogger("evalplane.backends.aws")


def estate_key_store(outputs: StackOutputs):
    """The gateway's provider keys: the estate's Secrets Manager store, which only the replicas read."""
    from gateway import keyfile
    from gateway.config import GatewaySettings

    return keyfile.store(GatewaySettings(database_url="", valkey_url="", provider_keys_store="secretsmanager",
                                         provider_keys_prefix=outputs.required("gateway_provider_keys_prefix")))


def require_provider_key(outputs: StackOutputs, name: str, field: str) -> None:
    """The gateway's store has a provider key `name` (metadata only: the dispatcher may not read one), else a
    RuntimeError naming `field`."""
    sm, store = aws.client("secretsmanager"), estate_key_store(outputs)
    try:
        sm.describe_secret(SecretId=store.secret_id(name))
    except sm.exceptions.ResourceNotFoundException:
        raise RuntimeError(f"{field}: the estate's gateway has no provider key {name!r} (secret"
                           f" {store.secret_id(name)}; stack config gatewayProviders)") from None


def put_run_secret(outputs: StackOutputs, name: str, value: str, run: str, description: str) -> str:
    """A secret of a run's own (under the estate's run_secrets_prefix, its KMS key), made or its value replaced;
    its ARN."""
    sm = aws.client("secretsmanager")
    try:
        return sm.create_secret(Name=name, SecretString=value, Description=description,
                                Tags=[{"Key": "evalplane:run", "Value": run}],
                                **({"KmsKeyId": outputs.kms_key_arn}
                                   if getattr(outputs, "kms_key_arn", None) else {}))["ARN"]
    except sm.exceptions.ResourceExistsException:
        return sm.put_secret_value(SecretId=name, SecretString=value)["ARN"]


class AwsBackend(Backend):
    launchers = ("ecs",)
    builds_images = False
    local_stack = False
    spot_capacity = True  # the estate's harness cluster has the FARGATE_SPOT capacity provider

    def __init__(self, spec):
        super().__init__(spec)
        # what the run's task definitions add to their container's secrets (env name -> secret ARN): open_gateway's
        self.task_secrets: dict[str, str] = {}
        self.provider_admin: tuple[str, str] | None = None  # (URL, admin key) of the run's ProviderKeys

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
        """The provider's endpoint; the key is no task's (open_gateway gives tasks their run's own gateway key)."""
        if self.spec.gateway is None:  # the estate gives tasks no other credential: no shared key, no provider's
            raise RuntimeError("gateway: tasks on the aws backend reach the model only through the estate's gateway"
                               " tier, holding their run's own key: add a [gateway] table to the spec")
        return self.spec.model.base_url or self.outputs.gateway_url, ""

    def start_eval_workers(self, res: RunResources, run_keys: RunKeys) -> None:
        """On the eval cluster, through the run's ECS launcher (which retries those not placed in retry_pending)."""
        self.launcher.launch_eval_workers(self.spec.eval.workers, run=self.spec.run.name, command=[
            "--queue", res.eval_queue_url, "--backend", self.spec.eval.backend, "--idle-exit", "900"])

    # ------------------------------------------------------------------ the gateway tier
    def run_key_secret_name(self) -> str:
        """The run's gateway key's secret: under the prefix the harness execution role may read, nothing else."""
        return f"{self.outputs.required('run_secrets_prefix')}{self.spec.run.name}/{task_shape.RUN_KEY_SECRET}"

    def key_store(self):
        return estate_key_store(self.outputs)

    def open_gateway(self, plan, conn, valkey_url: str, run_keys: RunKeys, upstream: str, provider_key: str):
        """The estate's gateway service: its replicas' database role made from its secret, the pool's alias
        registered with the provider's endpoint (model.base_url) and a provider key of the gateway's store (the
        operator's, named model.api_key_env; or the run's own, minted with the run's cap by [gateway]
        provider_keys with the account key in model.api_key_env here), the run's key minted and put in the run's
        secret for its task definitions."""
        import redis

        from dispatcher.provider_keys import lifecycle
        from gateway import grants, runs

        spec, out = self.spec, self.outputs
        if not spec.model.base_url:
            raise RuntimeError("model.base_url: on the aws backend the gateway's deployment of the model needs the"
                               " provider's endpoint")
        sm = aws.client("secretsmanager")
        role = json.loads(sm.get_secret_value(SecretId=out.required("gateway_database_secret_arn"))["SecretString"])
        grants.ensure_replica_role(conn, role["username"], role["password"])
        store = self.key_store()
        name = spec.model.api_key_env  # the operator's key: a secret of the store, set out of band
        if spec.provider_keys is not None:
            admin = provider_key or os.environ.get(spec.model.api_key_env, "")
            if not admin:
                raise RuntimeError(f"model.api_key_env: gateway.provider_keys mints the run's key with the account's"
                                   f" key, and environment variable {spec.model.api_key_env} is not set")
            self.provider_admin = (spec.model.base_url, admin)
            name, key = lifecycle.open_key(conn, spec.provider_keys, spec.model.base_url, admin, spec.run.name,
                                           spec.budget.run_usd, runs.key_name)
            if key is not None:
                store.put(name, key)
        else:
            require_provider_key(out, name, "model.api_key_env")
        gw = runs.open_run(conn, redis.Redis.from_url(valkey_url), spec, run_keys.run_secret, out.gateway_url,
                           spec.pool, [runs.deployment(spec.model.provider, spec.model.model, spec.model.base_url,
                                                       name)],
                           budget_usd=None if spec.provider_keys is not None else spec.budget.run_usd)
        self.task_secrets = {task_shape.UPSTREAM_KEY_ENV: self._put_run_secret(gw.key)}
        self.scale_gateway(conn)
        return gw

    def scale_gateway(self, conn) -> int | None:
        """The estate's gateway service raised to the replicas the run's forecast sized for it (`plan` prints them);
        never lowered, since other runs may share the tier (`pulumi up` sets it back to gatewayReplicas). The
        service's desired count after, or None where nothing says (no forecast kept, an estate without the outputs)."""
        from dispatcher import forecast

        made, out = forecast.recorded(conn, self.spec.run.name), self.outputs
        if made is None or made.gateway is None or not (out.gateway_cluster_name and out.gateway_service_name):
            return None
        ecs = aws.client("ecs")
        (service,) = ecs.describe_services(cluster=out.gateway_cluster_name,
                                           services=[out.gateway_service_name])["services"]
        if service["desiredCount"] >= made.gateway.replicas:
            return service["desiredCount"]
        ecs.update_service(cluster=out.gateway_cluster_name, service=out.gateway_service_name,
                           desiredCount=made.gateway.replicas)
        log.info("gateway service %s: %d replicas for %.1f calls/s (was %d)", out.gateway_service_name,
                 made.gateway.replicas, made.gateway.calls_per_s, service["desiredCount"])
        return made.gateway.replicas

    def _put_run_secret(self, key: str) -> str:
        """The run's key in its own secret (made, or its value replaced on a resume); its ARN."""
        return put_run_secret(self.outputs, self.run_key_secret_name(), key, self.spec.run.name,
                              "A run's gateway key (evalplane)")

    def close_gateway(self, conn, valkey) -> None:
        """The run's key revoked (gateway/runs.py), its secret deleted at once, and its provider key (where it has
        one) revoked after its usage is recorded, then removed from the gateway's store. Idempotent."""
        from dispatcher import store as records
        from dispatcher.provider_keys import lifecycle

        super().close_gateway(conn, valkey)
        sm = aws.client("secretsmanager")
        try:
            sm.delete_secret(SecretId=self.run_key_secret_name(), ForceDeleteWithoutRecovery=True)
        except sm.exceptions.ResourceNotFoundException:
            pass
        if self.provider_admin is not None:
            lifecycle.close_key(conn, *self.provider_admin, self.spec.run.name)
            row = records.provider_key(conn, self.spec.run.name)
            if row is not None:
                self.key_store().delete(row.key_name)
