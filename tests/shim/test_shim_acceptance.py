"""Acceptance at scale on the real Valkey and simulator: a paced pool holds its rate under 200 callers,
and 300 attempts sharing one run cap never spend past it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from shimtest import FAST_RETRIES, LOCAL_TOKEN, UPSTREAM_KEY, sim_stats

from contract import keys
from contract.models import AttemptRef, Usage
from contract.pricing import price
from shim.caps import micro
from shim.config import ShimConfig
from shim.server import Shim
from simulator import SimulatorConfig
from simulator.testing import simulator_process

BODY = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "go"}]}


def _slope(ts: list[float]) -> float:
    """Least-squares events per second through (t_i, i): robust to jitter at the window's edges."""
    n = len(ts)
    mt, mi = sum(ts) / n, (n - 1) / 2
    return sum((t - mt) * (i - mi) for i, t in enumerate(ts)) / sum((t - mt) ** 2 for t in ts)


@pytest.mark.alone  # a rate within 3% of the limit: the pacer's timing, not the machine's load
def test_paced_pool_holds_its_limit_under_200_callers(shim, valkey, unique):
    """Pool limit 1200 rpm (the provider allows 1500): 200 callers on 4 shim processes get 20 calls/s, no 429."""
    limit = 1200
    with simulator_process(SimulatorConfig(api_key=UPSTREAM_KEY, rpm=1500)) as url:
        pool = f"{unique}-pool"
        valkey.hset(keys.pool_limits(pool), mapping={"rpm": limit})
        shims = shim.many(url, [{"instance": f"repo__repo-{i}", "pacer_burst_s": 1.0} for i in range(4)])
        done: list[float] = []
        statuses: dict[int, int] = {}

        async def caller(session: aiohttp.ClientSession, base: str, stop: float) -> None:
            while time.monotonic() < stop:
                async with session.post(f"{base}/v1/messages", json=BODY, headers={"x-api-key": LOCAL_TOKEN}) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1
                    done.append(time.monotonic())

        async def main() -> float:
            t0 = time.monotonic()
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
                stop = t0 + 9.0
                await asyncio.gather(*(caller(s, shims[i % 4].base, stop) for i in range(200)))
            return t0

        t0 = asyncio.run(main())
        steady = sorted(t for t in done if t0 + 2.0 <= t <= t0 + 9.0)  # past the 1 s burst and the ramp
        rate = _slope(steady) * 60
        print(f"admitted {rate:.1f}/min over {len(steady)} calls (limit {limit}), statuses {statuses}")
        assert set(statuses) == {200}  # no 429 (nor anything else) surfaced
        assert sim_stats(url, "claude-sonnet-4-5")["errors"] == {}  # and none happened upstream either
        assert abs(rate - limit) <= 0.03 * limit
        rows = [r for s in shims for r in s.rows()]
        assert sum(r["pacer_wait_ms"] > 1000 for r in rows) > len(rows) / 2  # the callers queued in the pacer


def test_300_attempts_never_spend_past_the_run_cap(tmp_path, valkey_url, unique):
    """300 shims (one aiohttp app each, all in this process, sharing one Valkey client) of one run, each
    with a harness calling until refused. The run cap holds, every attempt ends budget_exceeded."""
    model = "claude-haiku-4-5"
    p = price(model)
    hold = micro(((len(json.dumps(BODY)) + 2) // 3) * p.input + BODY["max_tokens"] * p.output)
    cap_micro = hold * 600  # room for a few calls per attempt
    cap = cap_micro / 1e6
    n = 300

    async def main(url: str):
        # timeout=None: on a loaded machine a call waits for a free connection (the pool gives up after 20 s)
        r = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(valkey_url, max_connections=64,
                                                                            timeout=None))
        shims = []
        for i in range(n):
            d = tmp_path / f"a{i}"
            cfg = ShimConfig(upstream_url=url, provider="anthropic", model=model, pool=f"{unique}-pool",
                             ref=AttemptRef(run=unique, instance_id=f"repo__repo-{i}", attempt=1),
                             local_token=LOCAL_TOKEN, ledger_path=Path(d / "ledger.jsonl"), valkey_url=valkey_url,
                             run_cost_usd=cap, heartbeat_s=60, **FAST_RETRIES)
            shims.append(Shim(cfg, UPSTREAM_KEY, redis=r))
        for s in shims:
            await s.start()
        calls = [0] * n

        async def harness(i: int, session: aiohttp.ClientSession) -> int:
            while True:
                async with session.post(f"http://127.0.0.1:{shims[i].port}/v1/messages", json=BODY,
                                        headers={"x-api-key": LOCAL_TOKEN}) as resp:
                    body = await resp.json()
                    if resp.status != 200:
                        assert resp.status == 403 and body["error"]["type"] == "budget_exceeded"
                        assert resp.headers["x-should-retry"] == "false"
                        return i
                    calls[i] += 1

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(harness(i, session) for i in range(n)))
        statuses = [s.status() for s in shims]
        for s in shims:
            await s.stop()
        run = {k.decode(): int(v) for k, v in (await r.hgetall(keys.run_budget(unique))).items()
               if k in (b"spent", b"held", b"cap")}
        await r.aclose()
        return shims, statuses, calls, run

    with simulator_process(SimulatorConfig(api_key=UPSTREAM_KEY, ttft_ms=5)) as url:
        shims, statuses, calls, run = asyncio.run(main(url))
        truth = sim_stats(url, model)
    rows = [json.loads(line) for s in shims for line in s.ledger.path.read_text().splitlines()]
    spent = sum(r["cost_usd"] for r in rows)
    print(f"{sum(calls)} calls, spent ${spent:.6f} of ${cap:.6f}")
    assert all(st["stopped"] == "budget_exceeded" for st in statuses)  # each attempt lands budget_exceeded
    last = {}
    for r in rows:
        last[r["instance_id"]] = r
    assert len(last) == n and all(r["outcome"] == "budget_exceeded" and r["http_status"] == 403
                                  for r in last.values())
    assert spent <= cap and run["spent"] <= cap_micro and run["held"] == 0
    assert truth["requests"] == sum(calls) == sum(r["outcome"] == "ok" for r in rows)
    billed = Usage(**{f: truth[f] for f in ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")})
    assert spent == pytest.approx(p.cost(billed), rel=1e-6)  # what the provider billed is what was spent
    assert spent > cap / 2  # the cap was used, not refused early
