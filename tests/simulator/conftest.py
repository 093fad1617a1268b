"""Fixtures for the simulator tests."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def topic() -> str:
    """A unique first user message, so each test starts its own cached conversation."""
    return f"Tell me about case {uuid.uuid4().hex}."
