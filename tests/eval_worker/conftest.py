"""Fixtures for the eval worker tests: the committed synthetic instances and demo policy."""

from __future__ import annotations

import json

import pytest
from ew_helpers import SYNTH, load_instances


@pytest.fixture(scope="session")
def instances() -> dict[str, dict]:
    return load_instances()


@pytest.fixture(scope="session")
def demo_policy() -> dict:
    return json.loads((SYNTH / "demo_policy.json").read_text())
