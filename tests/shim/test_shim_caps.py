"""Turn and dollar caps: refused calls get 403 + x-should-retry false, are in the ledger, stop the shim."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from shimtest import LOCAL_TOKEN

from contract import keys
from contract.models import AttemptRef
from shim.caps import ValkeyBudget


def _hash(valkey, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in valkey.hgetall(key).items()}


def test_max_turns(sim, shim, valkey, unique):
    s = shim(sim(), provider="openai", model="gpt-4o-mini", limits={"max_turns": 3})
    client = s.openai()
    for i in range(3):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"turn {i}"}])
    for _ in range(2):  # the call after the last allowed one, and every one after it
        with pytest.raises(openai.PermissionDeniedError) as e:  # mini-swe-agent aborts on this
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
        assert e.value.response.headers["x-should-retry"] == "false"
        assert e.value.body["type"] == "max_turns_exceeded" or "max_turns_exceeded" in str(e.value.body)
    rows = s.rows()
    assert [r["outcome"] for r in rows] == ["ok"] * 3 + ["max_turns_exceeded"] * 2
    assert [r["http_status"] for r in rows] == [200] * 3 + [403] * 2
    st = s.status()
    assert st["stopped"] == "max_turns_exceeded" and st["calls"] == 5
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    assert _hash(valkey, keys.progress(ref))["stopped"] == "max_turns_exceeded"


def test_attempt_cost_cap(sim, shim, valkey, unique):
    cap = 0.003
    s = shim(sim(), limits={"cost_usd": cap})
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "spend"}]}
    ok = 0
    for _ in range(100):
        r = httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=body)
        if r.status_code != 200:
            break
        ok += 1
    assert r.status_code == 403 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["type"] == "budget_exceeded"
    assert ok >= 3
    rows = s.rows()
    assert rows[-1]["outcome"] == "budget_exceeded" and rows[-1]["cost_usd"] == 0
    spent = sum(r["cost_usd"] for r in rows)
    assert 0 < spent <= cap
    assert s.status()["stopped"] == "budget_exceeded"
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    budget = _hash(valkey, keys.attempt_budget(ref))
    assert int(budget["held"]) == 0 and int(budget["spent"]) <= cap * 1e6
    assert int(budget["spent"]) == pytest.approx(spent * 1e6, abs=len(rows))  # micro-dollars, rounded up
    assert _hash(valkey, keys.progress(ref))["stopped"] == "budget_exceeded"
    # once stopped, it stays stopped
    r = httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=body)
    assert r.status_code == 403


def test_run_cap_holds_under_concurrency(sim, shim, valkey, unique):
    """Ten harnesses on five shims of one run, calling as fast as they can until refused."""
    cap = 0.003
    url = sim(ttft_ms=20)
    shims = shim.many(url, [{"model": "claude-haiku-4-5", "instance": f"repo__repo-{i}", "run_cost_usd": cap}
                            for i in range(5)])
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "go"}]}

    def harness(base: str) -> int:
        with httpx.Client(headers={"x-api-key": LOCAL_TOKEN}, timeout=30) as c:
            for n in range(200):
                if c.post(f"{base}/v1/messages", json=body).status_code != 200:
                    return n
        return 200

    with ThreadPoolExecutor(10) as pool:
        done = list(pool.map(harness, [s.base for s in shims for _ in range(2)]))
    rows = [r for s in shims for r in s.rows()]
    spent = sum(r["cost_usd"] for r in rows)
    ok = sum(r["outcome"] == "ok" for r in rows)
    assert ok == sum(done) and ok >= 20
    assert spent <= cap
    assert all(s.status()["stopped"] == "budget_exceeded" for s in shims)
    run = _hash(valkey, keys.run_budget(unique))
    assert int(run["held"]) == 0 and int(run["spent"]) <= cap * 1e6 and int(run["cap"]) == cap * 1e6
    assert spent > cap / 2  # the cap was used, not refused early


def test_hold_lua_is_exact_under_concurrency(valkey_url, unique):
    async def main():
        # timeout=None: on a loaded machine a call waits for a free connection (the pool gives up after 20 s)
        r = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(valkey_url, max_connections=16,
                                                                            timeout=None))
        budgets = [ValkeyBudget(r, AttemptRef(run=unique, instance_id=f"i{i}", attempt=1), None, 0.0005, 60)
                   for i in range(8)]
        results = await asyncio.gather(*(budgets[i % 8].hold(f"c{i}", 7) for i in range(200)))
        admitted = [i for i, which in enumerate(results) if which == 0]
        assert len(admitted) == 500 // 7  # exactly what fits, not one more
        assert all(which == 2 for which in results if which)  # refused by the run cap
        await asyncio.gather(*(budgets[i % 8].settle(f"c{i}", 5) for i in admitted))
        run = await r.hgetall(keys.run_budget(unique))
        assert int(run[b"held"]) == 0 and int(run[b"spent"]) == 5 * len(admitted)
        # an attempt cap binds on its own attempt only
        b = ValkeyBudget(r, AttemptRef(run=unique + "x", instance_id="a", attempt=1), 0.00001, None, 60)
        assert await b.hold("x1", 10) == 0 and await b.hold("x2", 1) == 1
        # an unsettled hold expires and is swept by the next hold
        e = ValkeyBudget(r, AttemptRef(run=unique + "y", instance_id="a", attempt=1), 0.00001, None, 0.05)
        assert await e.hold("y1", 10) == 0 and await e.hold("y2", 10) == 1
        await asyncio.sleep(0.1)
        assert await e.hold("y3", 10) == 0
        await r.aclose()
        await r.connection_pool.disconnect()

    asyncio.run(main())
