"""Shared fixtures: the real PostgreSQL, the real Valkey/Redis, and moto's server mode for S3/SQS.

Each pytest session gets its own PostgreSQL database (dropped at the end), so sessions running side
by side never see each other's rows. Valkey keys are namespaced by run and pool names: tests use
unique names (see `unique`) and never FLUSHDB.

Every test gets one tier marker (unit, services, docker, e2e) from tests/tiers.py, where the tiers are described.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest
import redis

from contract import db
from plumbing.services import free_port
from tests import tiers

BASE_DATABASE_URL = os.environ.get("DATABASE_URL", db.DEFAULT_DATABASE_URL)
ROOT = Path(__file__).resolve().parents[1]
if worker := os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's docker-launcher runs on a network of its own
    os.environ.setdefault("EVALPLANE_TASK_NETWORK", f"evalplane-tasks-{worker}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    tiers.mark(items)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by tests.tiers.group_of: pytest-xdist 3.8's own grouping marks node ids in a way pytest 9
    ignores (every test then goes anywhere, and a shared run is made once per worker)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return tiers.group_of(nodeid.removeprefix("tests/"))

    return ByGroup(config, log)


def _with_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@pytest.fixture(scope="session")
def database_url() -> str:
    """A fresh, migrated database for this pytest session."""
    name = f"ep_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(BASE_DATABASE_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = _with_db(BASE_DATABASE_URL, name)
    with psycopg.connect(url) as conn:
        db.migrate(conn)
    old = os.environ.get("DATABASE_URL")
    os.environ["DATABASE_URL"] = url
    yield url
    if old is None:
        os.environ.pop("DATABASE_URL", None)
    else:
        os.environ["DATABASE_URL"] = old
    with psycopg.connect(BASE_DATABASE_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg(database_url):
    with psycopg.connect(database_url) as conn:
        yield conn


@pytest.fixture(scope="session")
def valkey_url() -> str:
    """The admin URL of the project's own Valkey (VALKEY_URL, else scripts/stack.sh's admin.url)."""
    from contract.valkey_auth import default_url

    url = default_url()
    redis.Redis.from_url(url).ping()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Each worker reaches Valkey at a loopback port of its own: the docker launcher relays a loopback endpoint
        # to its tasks from a host port equal to it, which one worker's run would otherwise hold for another's
        from urllib.parse import urlsplit

        from plumbing.relay import Relay

        u = urlsplit(url)
        port = free_port()
        Relay([("127.0.0.1", port, u.hostname, u.port or 6379)])
        url = u._replace(netloc=u.netloc.rsplit(":", 1)[0] + f":{port}").geturl()
        redis.Redis.from_url(url).ping()
        os.environ["VALKEY_URL"] = url  # for what the worker's tests start without asking for this fixture
    return url


@pytest.fixture
def valkey(valkey_url):
    r = redis.Redis.from_url(valkey_url)
    yield r
    r.close()


@pytest.fixture(scope="session")
def gateway_tier(database_url, valkey_url, tmp_path_factory):
    """(state folder, TierInfo): the gateway tier (gateway/tier.py), two replicas behind haproxy, for the session."""
    from gateway import tier

    state = tmp_path_factory.mktemp("gateway-state")
    info = tier.ensure(state, database_url, valkey_url)
    yield state, info
    tier.stop(state)


@pytest.fixture
def run_keys():
    """A run's message keys (contract.signing): the run secret and the verdict key."""
    from contract.signing import RunKeys

    return RunKeys(os.urandom(32).hex().encode(), os.urandom(32).hex().encode())


@pytest.fixture
def unique() -> str:
    """A short unique name for runs, pools and queues, so tests never collide in shared services."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto in server mode on loopback: S3 and SQS for everything that runs in other processes too."""
    from moto.server import ThreadedMotoServer

    from dispatcher.backends import moto_server

    moto_server.patch()  # the stand-in the dispatcher runs: no message lost to moto's delete race
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    from contract import aws

    aws.client.cache_clear()
    yield endpoint
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    aws.client.cache_clear()


@pytest.fixture(scope="session")
def docker_engine():
    """A Docker engine and the base images (scripts/docker.sh); under CI a missing engine fails, never skips."""
    for args in (["up"], ["base", "bullseye"]):
        p = subprocess.run([str(ROOT / "scripts/docker.sh"), *args], capture_output=True, text=True, check=False)
        if p.returncode != 0:
            tiers.unavailable("Docker", f"scripts/docker.sh {' '.join(args)} failed: {p.stderr[-2000:]}")
    import docker

    return docker.from_env(timeout=600)


_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")
