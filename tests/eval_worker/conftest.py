"""Fixtures for the eval worker tests: the committed synthetic instances and demo policy, and a real
Docker engine with the synthetic instances' instance images (built once, kept while their inputs hold).

Docker tests FAIL when CI=true and no engine can be started (scripts/docker.sh engine); without CI
they skip with the reason (tests.tiers.unavailable).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from ew_helpers import ROOT, SYNTH, load_instances

from tests.tiers import unavailable


@pytest.fixture(autouse=True)
def verdict_key(monkeypatch) -> bytes:
    """The key eval workers sign verdicts with (in their environment, as the dispatcher and the estate give it)."""
    from contract import signing

    key = os.urandom(32).hex().encode()
    monkeypatch.setenv(signing.VERDICT_KEY_ENV, key.decode())
    return key


@pytest.fixture(scope="session")
def instances() -> dict[str, dict]:
    return load_instances()


@pytest.fixture(scope="session")
def demo_policy() -> dict:
    return json.loads((SYNTH / "demo_policy.json").read_text())


def _ping():
    import docker

    try:
        client = docker.from_env(timeout=120)
        client.ping()
        return client
    except Exception:  # noqa: BLE001  (any failure means: no usable engine)
        return None


@pytest.fixture(scope="session")
def docker_client():
    client = _ping()
    if client is None:
        r = subprocess.run([str(ROOT / "scripts" / "docker.sh"), "engine"], capture_output=True, text=True,
                           timeout=600, check=False)
        client = _ping()
        if client is None:
            unavailable("Docker", f"scripts/docker.sh engine exited {r.returncode}: {r.stderr[-500:]}")
    from eval_worker.images import DEFAULT_BASE, ensure_base

    try:
        ensure_base(client, DEFAULT_BASE)  # scripts/docker.sh base bullseye when missing
    except RuntimeError as e:
        unavailable("Docker", str(e))
    return client


@pytest.fixture(scope="session")
def eval_images(docker_client, instances) -> dict[str, str]:
    """instance_id -> image id of its SWE-bench-shaped eval image (built if missing)."""
    from eval_worker.images import build_images

    built = build_images(list(instances.values()), repos_dir=SYNTH / "repos", client=docker_client)
    return {b.instance_id: b.image_id for b in built}


@pytest.fixture(scope="session")
def broken_row(docker_client, instances, eval_images):
    """evalplane__calc-1 on a deliberately broken image (its env has no pytest), under its own name."""
    from eval_worker.images import build_image

    row = {**instances["evalplane__calc-1"], "image": "evalplane-test/sweb.eval.broken-calc-1:latest"}
    build_image(row, repos_dir=SYNTH / "repos", client=docker_client, tag=row["image"], broken="no-pytest")
    return row


@pytest.fixture(scope="session")
def package_index(docker_client) -> str:
    """The project's package index, as the dispatcher starts it for docker gradings (dispatcher.backends.daemons)."""
    from dispatcher.backends import daemons
    from eval_worker.package_index import available

    url = daemons.ensure_package_index()
    assert available(url), f"the package index at {url} does not serve (see {daemons.state_dir()}/package-index.log)"
    return url


@pytest.fixture(scope="session")
def online_row(docker_client, instances, eval_images) -> dict:
    """evalplane__calc-2 on its image without the baked wheelhouse: its eval script's `pip install -e .` (build
    isolation) needs an index, as in the official images."""
    from eval_worker.images import without_wheelhouse

    row = {**instances["evalplane__calc-2"], "image": "evalplane-test/sweb.eval.online-calc-2:latest"}
    without_wheelhouse(docker_client, instances["evalplane__calc-2"]["image"], row["image"])
    return row
