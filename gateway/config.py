"""The gateway's settings (each replica's environment) and the one LiteLLM configuration every replica runs.

The replicas get their database as GATEWAY_DATABASE_URL, never DATABASE_URL: LiteLLM takes DATABASE_URL to mean
its own Prisma-backed mode, which cannot start here (gateway/__init__.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

DATABASE_ENV = "GATEWAY_DATABASE_URL"
VALKEY_ENV = "GATEWAY_VALKEY_URL"
KEYFILE_ENV = "GATEWAY_PROVIDER_KEYS_FILE"
KEY_STORE_ENV = "GATEWAY_PROVIDER_KEYS_STORE"  # a store in gateway.keyfile.KEY_STORES ("file" unless set)
KEY_PREFIX_ENV = "GATEWAY_PROVIDER_KEYS_PREFIX"  # the secretsmanager store's secret names start with it
# An estate hands a replica its database and Valkey users as ECS secrets, apart from the URLs (which carry none)
DATABASE_USER_ENV, DATABASE_PASSWORD_ENV = "GATEWAY_DATABASE_USER", "GATEWAY_DATABASE_PASSWORD"
VALKEY_USER_ENV, VALKEY_PASSWORD_ENV = "GATEWAY_VALKEY_USER", "GATEWAY_VALKEY_PASSWORD"
REPLICA_ENV = "GATEWAY_REPLICA"
MASTER_KEY_ENV = "LITELLM_MASTER_KEY"
HEALTH_MODEL = "gateway-health"  # a mock deployment: the router exists before any alias is loaded


class GatewaySettings(BaseModel):
    database_url: str
    valkey_url: str
    provider_keys_file: Path | None = None  # the "file" store's 0600 file
    provider_keys_store: str = "file"  # where the replicas find the provider keys deployments name (keyfile.py)
    provider_keys_prefix: str = ""  # the "secretsmanager" store's secret-name prefix
    replica: str = "gateway"
    alias_refresh_s: float = 5.0  # a replica re-reads an alias's deployments this often
    drain_interval_s: float = 0.5  # how often meter rows move from Valkey to PostgreSQL
    drain_batch: int = 500
    answer_ttl_s: float = 120.0  # a non-stream answer is kept this long for a retry of its call (gateway/replay.py)

    @classmethod
    def from_env(cls) -> GatewaySettings:
        """The replica's settings; a URL without credentials gets the user and password of its own variables."""
        from contract.valkey_auth import with_credentials

        env = os.environ
        database = with_credentials(env[DATABASE_ENV], env.get(DATABASE_USER_ENV, ""),
                                    env.get(DATABASE_PASSWORD_ENV, ""))
        valkey = with_credentials(env[VALKEY_ENV], env.get(VALKEY_USER_ENV, ""), env.get(VALKEY_PASSWORD_ENV, ""))
        return cls(database_url=database, valkey_url=valkey,
                   provider_keys_file=Path(env[KEYFILE_ENV]) if env.get(KEYFILE_ENV) else None,
                   provider_keys_store=env.get(KEY_STORE_ENV) or "file",
                   provider_keys_prefix=env.get(KEY_PREFIX_ENV, ""), replica=env.get(REPLICA_ENV, "gateway"))

    def env(self) -> dict[str, str]:
        out = {DATABASE_ENV: self.database_url, VALKEY_ENV: self.valkey_url, REPLICA_ENV: self.replica}
        if self.provider_keys_file is not None:
            out[KEYFILE_ENV] = str(self.provider_keys_file)
        if self.provider_keys_store != "file":
            out |= {KEY_STORE_ENV: self.provider_keys_store, KEY_PREFIX_ENV: self.provider_keys_prefix}
        return out


def litellm_config() -> dict:
    """LiteLLM's config: no database, our auth hook and meter, no retries (the shim owns them), the bundled price
    table (no fetch at start-up)."""
    return {
        "model_list": [{"model_name": HEALTH_MODEL,
                        "litellm_params": {"model": f"openai/{HEALTH_MODEL}", "mock_response": "ok", "api_key": "none"},
                        "model_info": {"id": HEALTH_MODEL}}],
        "litellm_settings": {"num_retries": 0, "request_timeout": 600, "callbacks": "gateway.meter.meter"},
        "general_settings": {"master_key": f"os.environ/{MASTER_KEY_ENV}", "custom_auth": "gateway.auth.user_api_key_auth"},
        "router_settings": {"num_retries": 0},
    }
