"""Task images built by the build verb (`python -m dispatcher images`): one per instance, FROM its instance image plus
the runtime layer, reused when nothing changed, pushed to a registry and run from it by digest; and inside each,
nothing the agent can reach says what came after the base commit. The checks read the image with git itself, not
the prune script."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from test_local_run import dispatcher, instances, write_spec

from contract import task_shape

pytestmark = pytest.mark.e2e


def images_spec(tmp_path: Path, run: str, extra: str = "") -> Path:
    spec = write_spec(tmp_path, run, gateway=False)
    text = spec.read_text().replace('kind = "local"', 'kind = "local"\nlauncher = "docker"')
    spec.write_text(text + extra)
    return spec


def recorded(database_url: str, registry: str) -> dict[str, str]:
    import psycopg

    with psycopg.connect(database_url) as conn:
        return dict(conn.execute("SELECT DISTINCT ON (instance_id) instance_id, ref FROM task_images"
                                 " WHERE registry = %s ORDER BY instance_id, built_at DESC", (registry,)))


@pytest.fixture(scope="module")
def built(docker_engine, tmp_path_factory, database_url, valkey_url, moto_endpoint):
    """Every synthetic instance's task image in the local engine, built (or found) once, then asked for again."""
    import os

    env = os.environ | {"DATABASE_URL": database_url}
    spec = images_spec(tmp_path_factory.mktemp("images"), "images-e2e")
    first = dispatcher(env, "images", str(spec), "--parallel", "2", timeout=2400)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = dispatcher(env, "images", str(spec), timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return first.stdout, second.stdout, recorded(database_url, "")


def sh(image: str, script: str) -> str:
    p = subprocess.run(["docker", "run", "--rm", "--entrypoint", "bash", image, "-c", script],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_every_instance_gets_its_task_image_once(built):
    first, second, refs = built
    n = len(instances())
    made = re.search(r"\b(\d+) built, (\d+) reused, 0 missing\b", first)  # built here, or by an earlier session
    assert made and int(made[1]) + int(made[2]) == n, first[-2000:]
    assert re.search(rf"\b0 built, {n} reused, 0 missing\b", second), second[-2000:]  # nothing rebuilt
    assert set(refs) == {r["instance_id"] for r in instances()}
    assert all(ref.startswith("sha256:") for ref in refs.values())  # the local engine's image ids


def test_images_reports_its_rate_and_bytes_and_forecast_predicts_them(built, tmp_path, database_url):
    """`images` says how fast it built and what the images share and add; `forecast` predicts the same spec's build
    from those records."""
    import os

    import psycopg

    from dispatcher import images as task_images

    env = os.environ | {"DATABASE_URL": database_url}
    n = len(instances())
    spec = images_spec(tmp_path, "images-rate")
    p = dispatcher(env, "images", str(spec), "--parallel", "3", "--force", timeout=2400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(rf"\b{n} built, 0 reused, 0 missing\b", p.stdout), p.stdout[-2000:]
    rate = re.search(r"task images: ([\d.]+) s, 3 at a time, ([\d.]+) images per minute", p.stdout)
    assert rate and float(rate[2]) == pytest.approx(n * 60 / float(rate[1]), rel=0.05), p.stdout[-2000:]
    shared = re.search(r"bytes \(uncompressed\): ([\d.]+) MB shared by every task image of mini-swe-agent", p.stdout)
    assert shared and float(shared[1]) > 100, p.stdout[-2000:]  # the runtime's own Python and packages at least

    f = dispatcher(env, "forecast", str(spec), timeout=600)
    assert f.returncode == 0, f.stdout[-3000:] + f.stderr[-3000:]
    with psycopg.connect(database_url) as conn:
        want = task_images.forecast_build(conn, "mini-swe-agent", n, 4)  # the spec's build_parallel: the default
    assert want.build_s is not None and want.registry_bytes > want.shared_bytes > 0
    assert f"predicted task image build: {want.build_s / 60:.1f} min for {n} image(s), 4 at a time" in f.stdout, \
        f.stdout
    assert f"predicted registry bytes: {want.registry_bytes / 1e6:.1f} MB uncompressed" in f.stdout, f.stdout


def test_a_task_image_goes_to_the_registry_and_runs_by_digest(built, local_registry, tmp_path, database_url,
                                                             docker_engine):
    """With [images] registry, the image is pushed and recorded by digest; a host without it pulls exactly that."""
    import os

    row = instances()[-1]
    spec = images_spec(tmp_path, "images-registry", f'\n[images]\nregistry = "{local_registry}"\n')
    spec.write_text(spec.read_text().replace("[budget]", f'ids = ["{row["instance_id"]}"]\n\n[budget]', 1))
    p = dispatcher(os.environ | {"DATABASE_URL": database_url}, "images", str(spec), timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ref = recorded(database_url, local_registry)[row["instance_id"]]
    assert ref.startswith(f"{local_registry}/evalplane/task@sha256:"), ref
    pulled = docker_engine.images.pull(ref)
    local = recorded(database_url, "")[row["instance_id"]]  # the latest local build (an earlier test may force one)
    assert pulled.id == docker_engine.images.get(local).id  # the very image built locally
    assert sh(ref, "git -C /testbed rev-parse HEAD").strip() == row["base_commit"]


def test_a_task_image_is_its_instance_image_plus_the_runtime(built, docker_engine):
    row = instances()[0]
    ref = built[2][row["instance_id"]]
    task = docker_engine.images.get(ref)
    base = docker_engine.images.get(row["image"])
    assert task.attrs["RootFS"]["Layers"][:len(base.attrs["RootFS"]["Layers"])] == base.attrs["RootFS"]["Layers"]
    assert task.attrs["Config"]["Entrypoint"] == task_shape.ENTRYPOINT
    # the runtime's own Python, and nothing of it in the instance's environment
    out = sh(ref, f"{task_shape.PYTHON} -c 'import harness.task, shim.server, minisweagent, sys; print(\"PY\", "
                  "sys.version)' >/tmp/py && grep ^PY /tmp/py && /opt/miniconda3/envs/testbed/bin/python -m pip freeze")
    assert out.startswith("PY 3.11")
    freeze_base = subprocess.run(["docker", "run", "--rm", "--entrypoint", "bash", row["image"], "-c",
                                  "/opt/miniconda3/envs/testbed/bin/python -m pip freeze"],
                                 capture_output=True, text=True, check=True).stdout
    # the same packages; only pip's description of the editable /testbed differs (its remote is gone)
    def packages(freeze: str) -> list[str]:
        return [ln for ln in freeze.splitlines() if ln and not ln.startswith(("-e ", "# Editable"))]
    assert packages(out.split("\n", 1)[1]) == packages(freeze_base) and len(packages(freeze_base)) >= 3


INSPECT = r"""
set -e
cd /testbed
echo "HEAD $(git rev-parse HEAD)"
git cat-file --batch-all-objects --batch-check='OBJ %(objecttype) %(objectname)'
git for-each-ref --format='REF %(refname) %(objectname) %(*objectname)'
for r in $(git remote); do echo "REMOTE $r"; done
git stash list | sed 's/^/STASH /'
if [ -d .git/logs ]; then find .git/logs -type f -size +0c | sed 's/^/REFLOG /'; fi
for f in FETCH_HEAD ORIG_HEAD objects/info/alternates; do [ ! -e .git/$f ] || echo "FILE $f"; done
git config --get-regexp '^remote\.' | sed 's/^/CONFIG /' || true
"""


def test_nothing_after_the_base_commit_is_reachable_in_any_task_image(built):
    for row in instances():
        ref, base = built[2][row["instance_id"]], row["base_commit"]
        lines = sh(ref, INSPECT).splitlines()
        kinds = {tag: [ln.split()[1:] for ln in lines if ln.startswith(tag + " ")]
                 for tag in ("HEAD", "OBJ", "REF", "REMOTE", "STASH", "REFLOG", "FILE", "CONFIG")}
        assert kinds["HEAD"] == [[base]], row["instance_id"]
        assert not any(kinds[k] for k in ("REMOTE", "STASH", "REFLOG", "FILE", "CONFIG")), (row["instance_id"], kinds)
        commits = [sha for kind, sha in kinds["OBJ"] if kind == "commit"]
        # every commit object in the store is the base or one of its ancestors
        check = " ".join(f"git merge-base --is-ancestor {c} {base} || echo LATER {c};" for c in commits)
        assert "LATER" not in sh(ref, f"cd /testbed && {check}"), row["instance_id"]
        for r in kinds["REF"]:
            assert r[0].startswith(("refs/tags/", "refs/heads/")), r
            commit = r[2] if len(r) > 2 else r[1]  # an annotated tag's commit, or the ref's own
            assert commit in commits, f"{row['instance_id']}: {r[0]} points past the base commit"


def test_the_instances_tags_before_the_base_survive(built):
    """A repository that versions itself from its tags (setuptools_scm, as pytest and astropy do) still installs at
    its real version in the task image: the agent's own `pip install -e .` works as it did upstream."""
    scm = 0
    for row in instances():
        ref = built[2][row["instance_id"]]
        out = sh(ref, "cd /testbed && if grep -q setuptools_scm pyproject.toml setup.cfg setup.py 2>/dev/null; then "
                      f"git describe --tags --abbrev=0 && {task_shape.CONDA_ACTIVATE} && python -m pip install -q -e . "
                      "&& python -m pip list --editable --format=json; fi")
        if not out.strip():
            continue
        scm += 1
        tag, listing = out.split("\n", 1)
        versions = [p["version"] for p in json.loads(listing)]
        assert versions and all(v.lstrip("v").startswith(tag.lstrip("v").rsplit(".", 1)[0]) for v in versions), \
            (row["instance_id"], tag, versions)
    assert scm >= 1, "no synthetic instance versions itself from its tags"
