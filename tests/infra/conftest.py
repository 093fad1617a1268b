"""Pulumi mock fixtures for the infra tests (see /work/shared/notes/pulumi-ray-moto.md section 1.2).

Every test gets a fresh event loop, its own Mocks + RecordingMonitor (set_mocks is process-global) and
`reset_options()` on teardown. Resources are built inside an inner `@pulumi.runtime.test` function,
which returns only after every RPC has reached the mock, then the test asserts on what was recorded.
"""

from __future__ import annotations

import asyncio

import pulumi
import pytest
from infra_support import EstateMocks, MockRun, RecordingMonitor, Snapshot, build_snapshot
from pulumi.runtime.settings import reset_options

reset_options()


def pytest_configure(config):
    # pulumi_aws emits DeprecationWarnings for the v1 aliases it still ships; they are noise here.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:pulumi_aws.*")


@pytest.fixture
def event_loop_per_test():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
    asyncio.set_event_loop(None)


@pytest.fixture
def pulumi_mocks(event_loop_per_test):
    """Fresh mocks per test (set_mocks is process-global); reset_options() on teardown."""
    mocks = EstateMocks()
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="evalplane", stack="test", preview=False, monitor=monitor)
    yield MockRun(mocks, monitor)
    reset_options()
    pulumi.runtime.set_all_config({})


@pytest.fixture(scope="session")
def estate_snapshot() -> Snapshot:
    """The default estate, built once per session (a few seconds) under its own mocks, loop and teardown."""
    return build_snapshot()
