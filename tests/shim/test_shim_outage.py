"""A provider outage through the shim: the pool's breaker trips, calls are held (not failed, not counted against
the attempt's wall time) and go on when the provider answers again; an outage past the bound ends the attempt as
provider_outage."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import pytest

from contract import keys

BREAKER = {"breaker_failures": 2, "breaker_window_s": 0.2, "breaker_probe_s": 0.3, "breaker_poll_s": 0.05}
ASK = {"model": "harness-model", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}


def _outage(url: str, seconds: float, status: int) -> None:
    httpx.post(f"{url}/_sim/outage", json={"seconds": seconds, "status": status}, timeout=10).raise_for_status()


@pytest.mark.parametrize("status", [529, 0])  # overloaded, and unreachable (connections dropped)
def test_calls_are_held_through_an_outage_and_go_on_after_it(sim, shim, valkey, status):
    url = sim()
    s = shim(url, limits={"wall_time_s": 2.0, "outage_bound_s": 30}, **BREAKER)
    a = s.anthropic()
    assert a.messages.create(**ASK).content[0].text
    _outage(url, 2.5, status)
    t0 = time.monotonic()
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(a.messages.create(**ASK))) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    tripped = valkey.hexists(keys.pool_breaker(s.cfg.pool), "open")
    for t in threads:
        t.join(timeout=30)
    took = time.monotonic() - t0
    assert tripped
    assert len(answers) == 3 and all(m.content[0].text for m in answers)
    assert took >= 2.4  # they waited the outage out ...
    rows = s.rows()
    assert [r["outcome"] for r in rows] == ["ok"] * 4
    held = sorted(r["held_ms"] for r in rows[1:])
    assert held[0] > 1500 and rows[0]["held_ms"] == 0  # ... held, and the ledger says how long
    st = s.status()
    assert st["stopped"] is None  # the 2 s wall time did not run while held
    assert st["held_s"] * 1000 >= sum(held) - 1
    assert not valkey.exists(keys.pool_breaker(s.cfg.pool))  # the probe's success closed it


def test_an_outage_past_the_bound_ends_the_attempt_as_provider_outage(sim, shim, valkey):
    url = sim()
    s = shim(url, limits={"outage_bound_s": 1.0}, **BREAKER)
    a = s.anthropic()
    _outage(url, 30, 503)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(**ASK)
    with pytest.raises(anthropic.BadRequestError) as again:
        a.messages.create(**ASK)
    assert "provider_outage" in str(e.value) and "provider_outage" in str(again.value)
    assert s.status()["stopped"] == "provider_outage"
    rows = s.rows()
    assert [r["outcome"] for r in rows] == ["provider_outage", "provider_outage"]
    assert rows[0]["held_ms"] >= 900 and rows[0]["http_status"] == 503
