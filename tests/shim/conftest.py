"""Fixtures for the shim: the simulator (in a thread) as upstream, shims as real subprocesses."""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack

import pytest
import redis
from shimtest import FAST_RETRIES, LOCAL_TOKEN, ROOT, UPSTREAM_KEY, ShimProc

from plumbing.services import ServiceFailed
from shim.child import shim_service
from shim.config import ShimConfig
from simulator import SimulatorConfig
from simulator.testing import running_simulator


@pytest.fixture(autouse=True)
def _valkey_cleanup(request, unique):
    """Every shim test names its runs and pools after `unique`: drop their Valkey keys afterwards, so the
    shared Valkey does not pile up test pools (autouse: set up first, so torn down after the shims die).
    Only for tests that use Valkey (`valkey_url`, directly or through `shim`/`valkey`): the rest need no Valkey."""
    if "valkey_url" not in request.fixturenames:
        yield
        return
    valkey_url = request.getfixturevalue("valkey_url")
    yield
    r = redis.Redis.from_url(valkey_url)
    try:
        batch = list(r.scan_iter(match=f"*{unique}*", count=1000))
        for i in range(0, len(batch), 500):
            r.delete(*batch[i:i + 500])
    finally:
        r.close()


@pytest.fixture
def sim():
    """start(**SimulatorConfig fields) -> base URL; the simulator only accepts the upstream key."""
    with ExitStack() as stack:

        def start(**kw) -> str:
            kw.setdefault("api_key", UPSTREAM_KEY)
            return stack.enter_context(running_simulator(SimulatorConfig(**kw)))

        yield start


@pytest.fixture
def shim(tmp_path, valkey_url, unique):
    """start(upstream_url, **ShimConfig overrides) -> ShimProc (a `python -m shim` subprocess);
    start.many(upstream_url, [overrides, ...]) starts several side by side."""
    procs: list[ShimProc] = []

    def spawn(upstream_url: str, *, key: str | None = UPSTREAM_KEY, instance: str = "repo__repo-1",
              attempt: int = 1, run: str | None = None, **overrides) -> ShimProc:
        d = tmp_path / f"shim{len(procs)}"
        d.mkdir()
        cfg = ShimConfig(**{
            "upstream_url": upstream_url,
            "provider": "anthropic",
            "model": "claude-sonnet-4-5",
            "pool": f"{unique}-pool",
            "ref": {"run": run or unique, "instance_id": instance, "attempt": attempt},
            "local_token": LOCAL_TOKEN,
            "ledger_path": str(d / "ledger.jsonl"),
            "port_file": str(d / "port"),
            "status_path": str(d / "status.json"),
            "valkey_url": valkey_url,
            **FAST_RETRIES,
            **overrides,
        })
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        service = shim_service(cfg, d / "shim.json", key, log=d / "stderr.log", env=env, cwd=ROOT, timeout_s=20)
        sp = ShimProc(service.spawn(), "", cfg, d)
        procs.append(sp)
        return sp

    def ready(sp: ShimProc) -> ShimProc:
        try:
            sp.service.wait_ready()
        except ServiceFailed:
            raise RuntimeError(f"shim did not start: {sp.log()}") from None
        sp.base = f"http://127.0.0.1:{sp.service.port}"
        return sp

    def start(upstream_url: str, **kw) -> ShimProc:
        return ready(spawn(upstream_url, **kw))

    def start_many(upstream_url: str, specs: list[dict]) -> list[ShimProc]:
        return [ready(sp) for sp in [spawn(upstream_url, **kw) for kw in specs]]

    start.many = start_many
    yield start
    for sp in procs:
        sp.service.stop(signal.SIGKILL)
