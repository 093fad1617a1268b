"""A new user's spec naming real SWE-bench Verified instances: `validate` says, per instance, what is missing and
where real instances run, instead of refusing with a bare "required"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IDS = ["pytest-dev__pytest-10081", "pytest-dev__pytest-5809"]

SPEC = """
[run]
name = "real"
[harness]
name = "mini-swe-agent"
[model]
provider = "openai"
model = "gpt-4o-mini"
[instances]
dataset = "verified"
ids = {ids}
[budget]
run_usd = 1.0
[backend]
kind = "local"
{backend}
"""


def validate(tmp_path: Path, backend: str, env: dict | None = None) -> subprocess.CompletedProcess:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(ids=str(IDS).replace("'", '"'), backend=backend))
    return subprocess.run([sys.executable, "-m", "dispatcher", "validate", str(spec)], capture_output=True,
                          text=True, cwd=ROOT, env=env or os.environ, timeout=120, check=False)


def test_the_process_launcher_names_what_it_needs_and_where_real_instances_run(tmp_path):
    p = validate(tmp_path, 'launcher = "process"')
    assert p.returncode == 2, p.stdout + p.stderr
    err = " ".join(p.stderr.split())
    assert "backend.launcher" in err and "instances.repos is not set" in err and "git bundle" in err
    assert 'launcher = "docker"' in err and "real instances" in err


@pytest.mark.docker
def test_the_docker_launcher_names_each_instance_without_an_image(tmp_path, database_url):
    from tests.tiers import unavailable

    engine = subprocess.run([str(ROOT / "scripts/docker.sh"), "engine"], capture_output=True, text=True, check=False)
    if engine.returncode != 0:
        unavailable("Docker", engine.stderr[-1000:])
    p = validate(tmp_path, 'launcher = "docker"', os.environ | {"DATABASE_URL": database_url})
    assert p.returncode == 2, p.stdout + p.stderr
    err = " ".join(p.stderr.split())
    for iid in IDS:
        assert f"{iid}: no image" in err, err
    assert "swebench/sweb.eval.x86_64.pytest-dev_1776_pytest-10081" in err
    p = validate(tmp_path, 'launcher = "docker"\n[images]\ninstance_registry = "mirror.example.invalid:5000"',
                 os.environ | {"DATABASE_URL": database_url})
    assert p.returncode == 2 and "not mirrored to mirror.example.invalid:5000" in " ".join(p.stderr.split())
