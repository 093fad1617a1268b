"""Heartbeat, harness disconnects and shutdown in the middle of a stream."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from shimtest import LOCAL_TOKEN, sim_stats

from contract import keys
from contract.models import AttemptRef

STREAM = {"model": "m", "max_tokens": 500, "stream": True,
          "messages": [{"role": "user", "content": "a long story please " * 10}]}


def test_heartbeat_refreshes_progress_while_idle(sim, shim, valkey, unique):
    s = shim(sim(), heartbeat_s=0.2)
    key = keys.progress(AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1))
    first = float(valkey.hget(key, "heartbeat_at"))
    valkey.expire(key, 5)
    deadline = time.monotonic() + 10
    while float(valkey.hget(key, "heartbeat_at")) <= first:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert valkey.ttl(key) > 5  # TTL refreshed to PROGRESS_TTL_S
    assert valkey.hget(key, "calls") == b"0"
    assert s.stop() == 0


def test_harness_disconnect_mid_stream_is_metered(sim, shim):
    url = sim(tokens_per_s=10)  # the short answer takes ~1 s: the harness leaves long before its end
    s = shim(url)
    with httpx.stream("POST", f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=STREAM) as r:
        assert r.status_code == 200
        got = b""
        for chunk in r.iter_bytes():
            got += chunk
            if b"content_block_delta" in got:
                break  # the harness goes away
    deadline = time.monotonic() + 10
    while not s.rows() and time.monotonic() < deadline:
        time.sleep(0.05)
    (row,) = s.rows()
    assert row["outcome"] == "stream_error" and row["usage_estimated"] is True
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0
    # the shim stopped reading, so the provider stopped sending before the end
    time.sleep(0.3)
    truth = sim_stats(url, "claude-sonnet-4-5")
    assert truth["requests"] == 1


def test_sigterm_during_stream(sim, shim):
    s = shim(sim(tokens_per_s=5), shutdown_timeout_s=0.3)  # the reply takes ~2 s
    started = threading.Event()
    outcome: list[object] = []

    def harness():
        try:
            with httpx.stream("POST", f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN},
                              json=STREAM, timeout=30) as r:
                for _ in r.iter_bytes():
                    started.set()
            outcome.append("ended")
        except httpx.HTTPError as e:
            outcome.append(e)

    t = threading.Thread(target=harness)
    t.start()
    assert started.wait(10)
    t0 = time.monotonic()
    assert s.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 10
    t.join(10)
    (row,) = s.rows()
    assert row["outcome"] == "stream_error" and row["http_status"] == 200 and row["usage_estimated"]
    assert row["input_tokens"] > 0
    status = json.loads((s.dir / "status.json").read_text())
    assert status["ledger_rows"] == 1 and status["calls"] == 1


def test_sigterm_while_a_call_waits_for_its_answer(sim, shim):
    """A non-stream call still waiting for the provider when shutdown_timeout_s runs out is cancelled, and
    still lands its one ledger row."""
    url = sim(tokens_per_s=5)
    s = shim(url, shutdown_timeout_s=0.3)  # the answer would take ~10 s
    got: list[object] = []

    def harness():
        try:
            got.append(httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, timeout=30,
                                  json={**STREAM, "stream": False, "max_tokens": 50}).status_code)
        except httpx.HTTPError as e:
            got.append(e)

    t = threading.Thread(target=harness)
    t.start()
    deadline = time.monotonic() + 10
    while not sum(m["requests"] for m in httpx.get(f"{url}/_sim/stats").json()["models"].values()):
        assert time.monotonic() < deadline  # until the provider has the call
        time.sleep(0.01)
    t0 = time.monotonic()
    assert s.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 10
    t.join(10)
    assert got and got[0] != 200
    (row,) = s.rows()
    assert row["outcome"] == "cancelled" and row["http_status"] == 0
    status = json.loads((s.dir / "status.json").read_text())
    assert status["ledger_rows"] == 1 and status["calls"] == 1 and status["in_flight"] == 0

