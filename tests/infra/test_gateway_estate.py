"""The AWS gateway tier (issue 34): the replicas run the local tier's configuration and plugin code, and the keys sit
where only their reader reaches them: the provider keys with the gateway's task role, the master key with its
execution role, a run's gateway key in a secret of the run's own that only the harness execution role reads.
Checked on the mocked estate (the IAM documents as the roles would be given them)."""

from __future__ import annotations

import fnmatch
import json

import yaml
from infra_support import build_snapshot

from components.config import EstateConfig
from components.gateway import CONFIG_KEY, ENTRYPOINT, database_user
from contract import task_shape
from gateway import config as gw


def _containers(s, family: str) -> list[dict]:
    (td,) = [r for r in s.of("aws:ecs/taskDefinition:TaskDefinition") if r.inputs["family"] == family]
    return json.loads(td.inputs["containerDefinitions"])


def _policies(s) -> dict[str, dict]:
    return {r.inputs["name"]: json.loads(r.inputs["policy"]) for r in s.of("aws:iam/rolePolicy:RolePolicy")}


def _real_arn(secret) -> str:
    """The ARN Secrets Manager gives a secret: its name (or name prefix plus a suffix), then -XXXXXX."""
    name = secret.inputs.get("name") or secret.inputs["namePrefix"] + "20260101"
    return f"arn:aws:secretsmanager:us-east-1:123456789012:secret:{name}-AbCdEf"


def _readers(s, secret) -> set[str]:
    """The role policies that allow GetSecretValue on `secret` (a Secret, by its ARN as the mock gives it or as
    Secrets Manager would, or an ARN): an IAM resource pattern's * matches anything."""
    arns = [secret] if isinstance(secret, str) else [secret.outputs["arn"], _real_arn(secret)]
    return {name for name, doc in _policies(s).items() for st in doc["Statement"]
            if st["Effect"] == "Allow" and "secretsmanager:GetSecretValue" in st["Action"]
            and any(fnmatch.fnmatchcase(arn, r) for r in st["Resource"] for arn in arns)}


def _secret(s, name: str):
    return s.one("aws:secretsmanager/secret:Secret", name)


def test_the_replica_runs_litellm_with_the_local_tiers_configuration_and_settings(estate_snapshot):
    s = estate_snapshot
    (c,) = _containers(s, "evalplane-gateway")
    assert c["entryPoint"] == ENTRYPOINT and c["entryPoint"][-1] == "litellm.proxy.proxy_cli"
    assert c["command"][c["command"].index("--port") + 1] == "4000"
    assert c["image"].endswith("/evalplane/platform:gateway-latest")  # our plugin code is in the image
    (obj,) = [o for o in s.of("aws:s3/bucketObjectv2:BucketObjectv2") if o.inputs["key"] == CONFIG_KEY]
    config = yaml.safe_load(obj.inputs["content"])
    assert config == gw.litellm_config()  # one configuration: DB-less, our auth hook and meter
    assert config["general_settings"]["custom_auth"] == "gateway.auth.user_api_key_auth"
    assert "store_model_in_db" not in config["general_settings"]
    env = {e["name"]: e["value"] for e in c["environment"]}
    assert (env["LITELLM_CONFIG_BUCKET_NAME"], env["LITELLM_CONFIG_BUCKET_OBJECT_KEY"]) == (
        s.outputs["bucket"], CONFIG_KEY)
    assert "DATABASE_URL" not in env  # LiteLLM would switch to its Prisma mode
    secrets = {x["name"]: x["valueFrom"] for x in c["secrets"]}
    # the replica reads GatewaySettings from exactly this environment, the users' secrets filled in by ECS
    filled = env | {k: f"value-of-{k.lower()}" for k in secrets}
    settings = _from(filled)
    assert settings.database_url == (f"postgresql://value-of-gateway_database_user:value-of-gateway_database_password"
                                     f"@{s.outputs['aurora_endpoint']}:5432/evalplane?sslmode=require")
    assert settings.valkey_url == (f"rediss://value-of-gateway_valkey_user:value-of-gateway_valkey_password"
                                   f"@{s.outputs['valkey_endpoint']}:6379/0")
    assert (settings.provider_keys_store, settings.provider_keys_prefix) == (
        "secretsmanager", s.outputs["gateway_provider_keys_prefix"])
    assert {k: v for k, v in env.items() if k.startswith("GATEWAY_")} == settings.model_copy(update={
        "database_url": env[gw.DATABASE_ENV], "valkey_url": env[gw.VALKEY_ENV]}).env()
    database = _secret(s, "evalplane-gateway-database").outputs["arn"]
    assert secrets == {
        gw.MASTER_KEY_ENV: s.outputs["gateway_master_key_secret_arn"],
        gw.DATABASE_USER_ENV: f"{database}:username::", gw.DATABASE_PASSWORD_ENV: f"{database}:password::",
        gw.VALKEY_USER_ENV: secrets[gw.VALKEY_USER_ENV], gw.VALKEY_PASSWORD_ENV: secrets[gw.VALKEY_PASSWORD_ENV]}
    assert secrets[gw.VALKEY_USER_ENV].startswith(
        _secret(s, "evalplane-state-valkey-gateway-secret").outputs["arn"])


def _from(env: dict[str, str]) -> gw.GatewaySettings:
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, env, clear=True):
        return gw.GatewaySettings.from_env()


def test_the_replica_count_is_the_configured_one():
    s = build_snapshot(EstateConfig(gatewayReplicas=3))
    assert s.one("aws:ecs/service:Service", "evalplane-gateway-service").inputs["desiredCount"] == 3


def test_generated_secrets_and_the_replicas_database_role(estate_snapshot):
    s = estate_snapshot
    versions = {v.inputs["secretId"]: v for v in s.of("aws:secretsmanager/secretVersion:SecretVersion")}
    for name in ("evalplane-gateway-master-key", "evalplane-gateway-database"):
        assert _secret(s, name).id in versions, name  # generated by the program: nothing to set by hand
    for name in ("evalplane-gateway-provider-key-anthropic-api-key", "evalplane-gateway-provider-key-openai-api-key"):
        assert _secret(s, name).id not in versions, name  # the operator's to set
    assert database_user("evalplane") == "evalplane_gateway"
    assert s.outputs["gateway_database_secret_arn"] == _secret(s, "evalplane-gateway-database").outputs["arn"]


def test_the_provider_keys_are_the_gateway_replicas_alone_and_a_runs_key_the_harness_tasks(estate_snapshot):
    s = estate_snapshot
    provider = [_secret(s, n) for n in ("evalplane-gateway-provider-key-anthropic-api-key",
                                        "evalplane-gateway-provider-key-openai-api-key")]
    assert [p.inputs["name"] for p in provider] == [s.outputs["gateway_provider_keys_prefix"] + k
                                                    for k in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY")]
    run_minted = f"arn:aws:secretsmanager:us-east-1:123456789012:secret:{s.outputs['gateway_provider_keys_prefix']}" \
                 "key-0123456789abcdef-AbCdEf"  # a run's own provider key, put in the store by its dispatcher
    for secret in [*provider, run_minted]:
        assert _readers(s, secret) == {"gateway-task"}, secret  # no execution role, no harness or judge role, no dispatcher
    assert _readers(s, _secret(s, "evalplane-gateway-master-key")) == {"gateway-exec"}
    assert _readers(s, _secret(s, "evalplane-gateway-database")) == {"gateway-exec", "dispatcher"}
    run_key = f"arn:aws:secretsmanager:us-east-1:123456789012:secret:{s.outputs['run_secrets_prefix']}r1/gateway-key-AbCdEf"
    assert _readers(s, run_key) == {"harness-exec"}
    # the dispatcher makes, replaces and deletes runs' keys and runs' provider keys without reading them back
    (manage,) = [st for st in _policies(s)["dispatcher"]["Statement"] if "secretsmanager:CreateSecret" in st["Action"]]
    assert "secretsmanager:GetSecretValue" not in manage["Action"]
    assert any(fnmatch.fnmatchcase(run_key, r) for r in manage["Resource"])
    assert any(fnmatch.fnmatchcase(run_minted, r) for r in manage["Resource"])


def test_no_harness_task_definition_names_a_provider_key_or_the_master_key(estate_snapshot):
    s = estate_snapshot
    (task,) = _containers(s, "evalplane-harness")
    text = json.dumps(task)
    for forbidden in ("provider-key", "master-key", "ANTHROPIC_API_KEY", "OPENAI_API_KEY", gw.MASTER_KEY_ENV,
                      task_shape.UPSTREAM_KEY_ENV):
        assert forbidden not in text, forbidden
    (gateway,) = _containers(s, "evalplane-gateway")
    assert "ANTHROPIC_API_KEY" not in json.dumps(gateway)  # not even the gateway's holds one: its task role reads them


def test_the_dispatcher_may_scale_the_gateway_service_and_no_other_tier(estate_snapshot):
    """A run raises the gateway service's desired count to what its plan sized (AwsBackend.scale_gateway): the
    dispatcher's role may describe and update that service, by the names the stack outputs give it."""
    s = estate_snapshot
    assert (s.outputs["gateway_cluster_name"], s.outputs["gateway_service_name"]) == ("evalplane-gateway",) * 2
    assert s.one("aws:ecs/service:Service", "evalplane-gateway-service").inputs["name"] == "evalplane-gateway"
    (scale,) = [st for st in _policies(s)["dispatcher"]["Statement"] if "ecs:UpdateService" in st["Action"]]
    assert sorted(r.rsplit(":", 1)[1] for r in scale["Resource"]) == [
        "service/evalplane-eval/evalplane-eval-worker", "service/evalplane-gateway/evalplane-gateway"]
