"""What each image of the task runtime is keyed by: a change to the project's code changes the runtime base (and so
every task image) but neither the runtime's packages nor any harness layer, which are the slow builds; a change to the
pins changes them all."""

from __future__ import annotations

import uuid

import pytest

from dispatcher import images

HARNESSES = ("mini-swe-agent", "claude-code", "aider")


def keys() -> dict[str, str]:
    out = {"packages": images.packages_inputs(), "base": images.base_inputs()}
    for h in HARNESSES:
        out[f"harness {h}"] = images.harness_inputs(h)
        out[f"runtime {h}"] = images.runtime_inputs(h)
    return out


@pytest.fixture
def code_file(monkeypatch):
    """One more file of the project's code, under the checkout (as every file the runtime carries is)."""
    path = images.ROOT / ".state" / f"test-image-inputs-{uuid.uuid4().hex}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text("A = 1\n")
    files = images._app_files()
    monkeypatch.setattr(images, "_app_files", lambda: [*files, path])
    yield path
    path.unlink()


def test_a_change_to_the_code_rebuilds_only_the_code_layer(code_file):
    before = keys()
    code_file.write_text("A = 2\n")
    after = keys()
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"base"} | {f"runtime {h}" for h in HARNESSES}


def test_a_change_to_the_pins_rebuilds_everything(monkeypatch):
    before = keys()
    pins = images._constraints()
    monkeypatch.setattr(images, "_constraints", lambda: pins + "extra-package==1.0\n")
    after = keys()
    assert all(before[k] != after[k] for k in before)


def test_every_runtime_key_is_its_own():
    k = keys()
    assert len(set(k.values())) == len(k)


def test_the_runtime_is_pinned_by_what_it_needs_of_the_lock_and_nothing_else():
    pins = {line.split("==")[0] for line in images._constraints().splitlines()}
    assert {"litellm", "mini-swe-agent", "aiohttp", "boto3", "redis", "hiredis"} <= pins  # required, and an extra's
    assert {"openai", "httpx", "pydantic-core", "botocore"} <= pins  # what those require, however deep
    assert not {"pytest", "pytest-xdist", "ray", "pulumi", "moto", "via"} & pins  # the project's own tooling
