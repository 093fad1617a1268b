import os
import subprocess
from pathlib import Path

import pytest

from tests.tiers import unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path, database_url, valkey_url, moto_endpoint):
    """The environment of a dispatcher run: this session's database, the shared Valkey, moto, a fresh state dir."""
    return os.environ | {
        "DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "AWS_ENDPOINT_URL": moto_endpoint,
        "EVALPLANE_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0",
    }


@pytest.fixture(scope="session")
def local_registry(docker_engine, tmp_path_factory):
    """A private registry on loopback (scripts/registry.sh: Debian's docker-registry) on a port of this session."""
    from tests.conftest import free_port

    port = str(free_port())
    env = os.environ | {"EVALPLANE_STATE_DIR": str(tmp_path_factory.mktemp("registry"))}
    p = subprocess.run([str(ROOT / "scripts/registry.sh"), "up", port], capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        unavailable("the local registry", f"scripts/registry.sh up failed: {p.stderr[-2000:]}")
    yield p.stdout.strip()
    subprocess.run([str(ROOT / "scripts/registry.sh"), "down", port], env=env, check=False)
