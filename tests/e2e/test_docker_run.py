"""End to end with containers: every attempt in its own task image (its instance's image plus the task runtime,
built by `python -m dispatcher images`) behind the egress (docker launcher), grading in the SWE-bench-shaped
instance images through the official run_instance (docker eval backend), and the dispatcher refusing instances
whose image has no valid gold validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_local_run import SYNTHETIC, counts, demo_expectation, dispatcher, write_spec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def images(docker_engine):
    """The synthetic instances' SWE-bench-shaped images (built once, cached)."""
    p = subprocess.run([sys.executable, str(ROOT / "images/swebench/build.py"), "--dataset",
                        str(SYNTHETIC / "instances.jsonl")], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr[-3000:]


def docker_spec(tmp_path: Path, run: str, validated: str) -> Path:
    spec = write_spec(tmp_path, run, gateway=False)
    text = spec.read_text()
    text = text.replace('kind = "local"', 'kind = "local"\nlauncher = "docker"')
    text = text.replace("[eval]", f'[eval]\nbackend = "docker"\nrequire_validated = "{validated}"')
    spec.write_text(text)
    return spec


def test_docker_tasks_and_official_grading_end_to_end(images, tmp_path, env, database_url, unique):
    spec = docker_spec(tmp_path, unique, "refuse")
    built = dispatcher(env, "images", str(spec), timeout=2400)  # the task images, in the local engine
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    # Nothing validated yet: the dispatcher refuses, and writes nothing.
    p = dispatcher(env, "run", str(spec))
    assert p.returncode == 2 and "eval.require_validated" in p.stderr, p.stderr[-2000:]
    assert counts(database_url, unique)["run"] is None

    v = subprocess.run([sys.executable, "-m", "eval_worker", "validate", "--dataset", str(SYNTHETIC / "instances.jsonl"),
                        "--backend", "docker", "--logs-root", str(tmp_path / "validate")],
                       env=env, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
    assert all(json.loads(line)["valid"] for line in v.stdout.splitlines() if line.startswith("{"))

    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"), timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    got = counts(database_url, unique)
    assert got["status"] == demo_expectation()
    for iid, n_calls, tokens_in, tokens_out, attempt_calls in got["per_attempt"]:
        assert n_calls >= 1 and tokens_in > 0 and attempt_calls == n_calls, iid
    report = json.loads((tmp_path / "out" / f"gpt-4o-mini.{unique}.json").read_text())
    assert report["error_ids"] == [] and len(report["resolved_ids"]) == sum(
        1 for s in demo_expectation().values() if s == "RESOLVED")
    import docker

    left = docker.from_env().containers.list(all=True, filters={"label": f"evalplane.run={unique}"})
    assert left == []  # every task container was reaped


@pytest.fixture(autouse=True)
def forget_validations(database_url):
    """The validation records this module writes are shared state of the session's database: remove them."""
    yield
    import psycopg

    ids = [json.loads(x)["instance_id"] for x in (SYNTHETIC / "instances.jsonl").read_text().splitlines() if x.strip()]
    with psycopg.connect(database_url) as conn:
        conn.execute("DELETE FROM image_validations WHERE instance_id = ANY(%s)", (ids,))
