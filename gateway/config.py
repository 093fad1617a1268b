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
REPLICA_ENV = "GATEWAY_REPLICA"
MASTER_KEY_ENV = "LITELLM_MASTER_KEY"
HEALTH_MODEL = "gateway-health"  # a mock deployment: the router exists before any alias is loaded


class GatewaySettings(BaseModel):
    database_url: str
    valkey_url: str
    provider_keys_file: Path
    replica: str = "gateway"
    alias_refresh_s: float = 5.0  # a replica re-reads an alias's deployments this often
    drain_interval_s: float = 0.5  # how often meter rows move from Valkey to PostgreSQL
    drain_batch: int = 500

    @classmethod
    def from_env(cls) -> GatewaySettings:
        return cls(database_url=os.environ[DATABASE_ENV], valkey_url=os.environ[VALKEY_ENV],
                   provider_keys_file=Path(os.environ[KEYFILE_ENV]), replica=os.environ.get(REPLICA_ENV, "gateway"))

    def env(self) -> dict[str, str]:
        return {DATABASE_ENV: self.database_url, VALKEY_ENV: self.valkey_url,
                KEYFILE_ENV: str(self.provider_keys_file), REPLICA_ENV: self.replica}


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
