"""Task images of one harness share their runtime and harness layers: the same layer digests in every task image, so
a registry stores them once and a second task image adds only its own pruned /testbed. Measured on the registry's
own storage (scripts/registry.sh du), with the instance images mirrored there first as a run's would be."""

from __future__ import annotations

import json
import urllib.request

import psycopg
import pytest
from test_local_run import SYNTHETIC, instances

from dispatcher import images as task_images
from eval_worker.mirror import push_image

pytestmark = pytest.mark.e2e

HARNESS = "mini-swe-agent"


def manifest(ref: str) -> dict:
    """The image manifest the registry holds for `ref` (host/repository@digest)."""
    host, _, rest = ref.partition("/")
    repository, _, digest = rest.partition("@")
    req = urllib.request.Request(f"http://{host}/v2/{repository}/manifests/{digest}",
                                 headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def test_a_second_task_image_adds_only_its_own_layer(docker_engine, database_url, empty_registry):
    rows = [r for r in instances() if r["instance_id"] in ("evalplane__calc-1", "evalplane__textkit-1")]
    assert len(rows) == 2
    registry = empty_registry.host
    with psycopg.connect(database_url) as conn:
        bases = {r["instance_id"]: task_images.resolve_instance_image(
            docker_engine, r, database_url=database_url, instance_registry=None, repos_dir=str(SYNTHETIC / "repos"))
            for r in rows}
        for r in rows:  # the instance images are in the registry before any task image, as mirrored ones are
            push_image(docker_engine, r["image"], registry, pull=False)
        stored = [empty_registry.stored_bytes()]
        made = []
        for r in rows:
            build = task_images.ensure_task_images([r], HARNESS, conn, registry=registry,
                                                   repos_dir=str(SYNTHETIC / "repos"), client=docker_engine)
            assert not build.problems, build.problems
            made.append(build.images[r["instance_id"]])
            stored.append(empty_registry.stored_bytes())
    runtime = build.runtime

    # the same three layers (the runtime's packages, the harness, the project's code), right above each instance
    # image's own, in both task images
    layers = [docker_engine.images.get(t.image_id).attrs["RootFS"]["Layers"] for t in made]
    own = [len(docker_engine.images.get(bases[t.instance_id]).attrs["RootFS"]["Layers"]) for t in made]
    shared = [docker_engine.images.get(tag).attrs["RootFS"]["Layers"] for tag in runtime.layers]
    assert all(len(s) == 1 for s in shared)
    for lay, n in zip(layers, own):
        assert lay[n:n + 3] == [s[0] for s in shared]
    assert layers[0][own[0] + 3:] != layers[1][own[1] + 3:]  # the pruned /testbed is each instance's own

    # and the same blobs in the registry: the second push stores only what is its own
    pushed = [manifest(t.ref)["layers"] for t in made]
    runtime_blob = pushed[0][own[0]]
    assert pushed[1][own[1]:own[1] + 3] == pushed[0][own[0]:own[0] + 3]
    first, second = stored[1] - stored[0], stored[2] - stored[1]
    assert first > runtime_blob["size"]  # the first task image did store the runtime
    assert second < 0.1 * runtime_blob["size"], (first, second, runtime_blob["size"])
    assert made[1].own_bytes is not None and made[1].own_bytes < made[1].layer_bytes
