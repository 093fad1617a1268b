import os

import pytest


@pytest.fixture
def env(tmp_path, database_url, valkey_url, moto_endpoint):
    """The environment of a dispatcher run: this session's database, the shared Valkey, moto, a fresh state dir."""
    return os.environ | {
        "DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "AWS_ENDPOINT_URL": moto_endpoint,
        "EVALPLANE_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0",
    }
