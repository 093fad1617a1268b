import os
import subprocess
from pathlib import Path

import pytest

from tests.tiers import unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path, database_url, valkey_url, moto_endpoint):
    """The environment of a dispatcher run: this session's database, the shared Valkey, moto, a fresh state dir.
    A gateway tier the run started (the demo spec's [gateway]) outlives its driver: stopped after the test."""
    from gateway import tier

    yield os.environ | {
        "DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "AWS_ENDPOINT_URL": moto_endpoint,
        "EVALPLANE_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0",
    }
    tier.stop(tmp_path / "state")


class LoopbackRegistry:
    """scripts/registry.sh's registry on a port of its own, its storage in a state dir of its own."""

    def __init__(self, state_dir: Path):
        from tests.conftest import free_port

        self.port = str(free_port())
        self.env = os.environ | {"EVALPLANE_STATE_DIR": str(state_dir)}
        self.host = self._script("up").strip()

    def _script(self, verb: str) -> str:
        p = subprocess.run([str(ROOT / "scripts/registry.sh"), verb, self.port], capture_output=True, text=True,
                           env=self.env, check=False)
        if p.returncode != 0:
            unavailable("the local registry", f"scripts/registry.sh {verb} failed: {p.stderr[-2000:]}")
        return p.stdout

    def stored_bytes(self) -> int:
        """What its storage holds (scripts/registry.sh du): blobs, manifests and their links."""
        return int(self._script("du"))

    def down(self) -> None:
        self._script("down")


@pytest.fixture(scope="session")
def local_registry(docker_engine, tmp_path_factory):
    """A private registry on loopback (scripts/registry.sh: Debian's docker-registry) on a port of this session."""
    registry = LoopbackRegistry(tmp_path_factory.mktemp("registry"))
    yield registry.host
    registry.down()


@pytest.fixture
def empty_registry(docker_engine, tmp_path_factory):
    """A registry of this test alone, empty at first, whose storage the test can measure."""
    registry = LoopbackRegistry(tmp_path_factory.mktemp("registry"))
    yield registry
    registry.down()
