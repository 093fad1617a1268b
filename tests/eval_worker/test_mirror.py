"""Mirror into a real registry on loopback (Debian's docker-registry) and grade by digest only."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

import pytest
from ew_helpers import make_job

from contract.models import EvalOutcome
from eval_worker.docker_backend import DockerGrader
from eval_worker.grading import grade
from eval_worker.mirror import mirror
from eval_worker.pinning import ImageResolver
from eval_worker.records import mirror_record


@pytest.fixture(scope="module")
def registry(tmp_path_factory, docker_client):
    from tests.tiers import unavailable

    exe = shutil.which("docker-registry")
    if exe is None:
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "docker-registry"]):
            subprocess.run(cmd, capture_output=True, timeout=600, check=False,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        exe = shutil.which("docker-registry")
    if exe is None:
        unavailable("docker-registry", "the Debian package is not installed")
    from tests.conftest import free_port

    port = free_port()
    d = tmp_path_factory.mktemp("registry")
    (d / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {d / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([exe, "serve", str(d / "config.yml")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def test_mirror_then_grade_by_digest_only(registry, docker_client, eval_images, instances, pg, unique, tmp_path):
    src = instances["evalplane__calc-2"]
    # a uniquely named copy of the instance image, so removing it cannot disturb other tests
    row = {**src, "image": f"evalplane-test/sweb.eval.mirror-{unique}:latest"}
    docker_client.images.get(src["image"]).tag(row["image"])
    records, errors = mirror([row], registry, pg, pull=False)
    assert errors == [] and len(records) == 1
    rec = mirror_record(pg, row["image"], registry)
    assert rec == records[0]
    assert rec.ref == f"{registry}/evalplane-test/sweb.eval.mirror-{unique}@{rec.digest}"
    assert rec.digest.startswith("sha256:") and rec.image_id == eval_images[src["instance_id"]]
    docker_client.images.remove(row["image"])  # the local tag is gone: only the registry has it

    backend = DockerGrader(client=docker_client, resolver=ImageResolver(os.environ["DATABASE_URL"], registry))
    assert backend.pin(row).ref == rec.ref
    v = grade(make_job(row, run=f"{unique}-mirror"), row["patch"], tmp_path, backend)
    assert v.outcome is EvalOutcome.RESOLVED, v
    assert rec.ref in docker_client.images.get(rec.ref).attrs["RepoDigests"]  # pulled by digest

    # an image without a mirror record in this registry is not pulled by tag: infrastructure error
    other = {**instances["evalplane__textkit-1"]}
    v = grade(make_job(other, run=f"{unique}-unmirrored"), other["patch"], tmp_path, backend)
    assert v.outcome is EvalOutcome.INFRA_ERROR and "not mirrored" in v.reason
