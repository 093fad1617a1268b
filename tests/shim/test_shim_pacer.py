"""The pool pacer's Lua scripts on the real Valkey: GCRA booking, all-or-nothing dimensions, settle, 429s."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from contract import keys
from shim.pacer import PaceRequest, ValkeyPacer, throttled_dimension


def _run(valkey_url: str, body) -> None:
    async def main():
        r = aioredis.Redis.from_url(valkey_url)
        try:
            await body(r)
        finally:
            await r.aclose()

    asyncio.run(main())


async def _book(p: ValkeyPacer, rpm: int = 1, itpm: int = 0, otpm: int = 0, max_wait_ms: float | None = None):
    """One raw admission (no sleeping): (admitted, wait_ms)."""
    ok, wait = await p._admit(keys=p.keys, args=[p.burst_ms, p.max_wait_ms if max_wait_ms is None else max_wait_ms,
                                                 rpm, itpm, otpm])
    return int(ok), int(wait)


def test_gcra_books_a_schedule(valkey_url, unique):
    """60 rpm with 2 s of burst: two calls at once, then one a second; the caller is told exactly when."""
    pool = f"{unique}-pool"

    async def body(r):
        await r.hset(keys.pool_limits(pool), mapping={"rpm": 60})
        p = ValkeyPacer(r, pool, burst_s=2.0, max_wait_s=30.0)
        waits = [(await _book(p))[1] for _ in range(5)]
        assert waits[:2] == [0, 0]
        for n, w in enumerate(waits[2:], start=1):
            assert w == pytest.approx(1000 * n, abs=60), waits
        # refused beyond max_wait, and nothing booked
        before = await r.hget(keys.pool_pacer(pool), "rpm")
        ok, wait = await _book(p, max_wait_ms=1000)
        assert ok == 0 and wait == pytest.approx(4000, abs=60)
        assert await r.hget(keys.pool_pacer(pool), "rpm") == before
        assert 60000 < await r.pttl(keys.pool_pacer(pool)) <= 5000 + 60000 + 100  # expires once all is past

    _run(valkey_url, body)


def test_unlimited_pool_admits_at_once_and_writes_nothing(valkey_url, unique):
    pool = f"{unique}-pool"

    async def body(r):
        p = ValkeyPacer(r, pool, burst_s=1.0)
        for _ in range(20):
            assert await _book(p, itpm=10**6, otpm=10**5) == (1, 0)
        assert await r.exists(keys.pool_pacer(pool)) == 0
        assert await p.admit(PaceRequest(pool, 10**6, 10**5)) == 0.0

    _run(valkey_url, body)


def test_dimensions_are_all_or_nothing_and_settle_refunds(valkey_url, unique):
    """rpm 600 (100 ms/request), otpm 6000 (10 ms/token), burst 1 s: output binds, a refund brings calls forward."""
    pool = f"{unique}-pool"

    async def body(r):
        await r.hset(keys.pool_limits(pool), mapping={"rpm": 600, "otpm": 6000})
        p = ValkeyPacer(r, pool, burst_s=1.0, max_wait_s=30.0)
        assert await _book(p, otpm=200) == (1, 0)  # 2000 ms of output > the burst: goes on a full bucket
        ok, wait = await _book(p, otpm=200)
        assert ok == 1 and wait == pytest.approx(2000, abs=60)  # otpm binds, not rpm
        tat = {k.decode(): float(v) for k, v in (await r.hgetall(keys.pool_pacer(pool))).items()}
        assert tat["otpm"] - tat["rpm"] == pytest.approx(2000 + 2000 - 2100, abs=5)  # rpm booked at the start
        # both calls used 50 of their 200 output tokens: 2 x 150 x 10 ms refunded
        req = PaceRequest(pool, 0, 200)
        await p.settle(req, None, 50)
        await p.settle(req, None, 50)
        ok, wait = await _book(p, otpm=200)
        # otpm could go at +1000 ms now, but the second call booked its request at +2000: rpm binds at +2100-900
        assert ok == 1 and wait == pytest.approx(1200, abs=60)
        # a refund never makes a bucket fuller than full
        for _ in range(20):
            await p.settle(req, None, 0)
        tat2 = float(await r.hget(keys.pool_pacer(pool), "otpm"))
        assert await _book(p, rpm=0, otpm=100) == (1, 0)  # (no request cost: rpm is booked ahead)
        assert float(await r.hget(keys.pool_pacer(pool), "otpm")) >= tat2
        # a settle above the reservation charges the difference
        before = float(await r.hget(keys.pool_pacer(pool), "otpm"))
        await p.settle(PaceRequest(pool, 0, 100), None, 400)
        assert float(await r.hget(keys.pool_pacer(pool), "otpm")) == pytest.approx(before + 3000, abs=60)

    _run(valkey_url, body)


def test_limit_changes_apply_to_the_next_admission(valkey_url, unique):
    """The dispatcher rewrites pool_limits; the script reads it on every call."""
    pool = f"{unique}-pool"

    async def body(r):
        await r.hset(keys.pool_limits(pool), mapping={"rpm": 60})
        p = ValkeyPacer(r, pool, burst_s=1.0)
        assert (await _book(p))[1] == 0
        assert (await _book(p))[1] == pytest.approx(1000, abs=60)
        await r.hset(keys.pool_limits(pool), mapping={"rpm": 600})
        assert (await _book(p))[1] == pytest.approx(1100, abs=60)  # the booked second, then 100 ms
        await r.hdel(keys.pool_limits(pool), "rpm")  # unlimited again
        assert (await _book(p))[1] == 0

    _run(valkey_url, body)


def test_429_holds_the_pool_and_counts(valkey_url, unique):
    pool = f"{unique}-pool"

    async def body(r):
        p = ValkeyPacer(r, pool, burst_s=1.0, max_retry_after_s=5.0)
        req = PaceRequest(pool, 10, 10)
        await p.throttled(req, 0.5, None)  # an unlimited pool still waits out the retry-after
        assert (await _book(p))[1] == pytest.approx(500, abs=60)
        await p.throttled(req, 100.0, None)  # clipped to max_retry_after_s
        assert (await _book(p))[1] == pytest.approx(5000, abs=60)
        assert int(await r.hget(keys.pool_discovered(pool), keys.THROTTLED_FIELD)) == 2
        # a limited dimension named by the 429 is emptied at that moment: then one call per interval
        pool2 = f"{unique}-pool2"
        await r.hset(keys.pool_limits(pool2), mapping={"rpm": 600, "itpm": 60000})
        p2 = ValkeyPacer(r, pool2, burst_s=1.0)
        await p2.throttled(req, 0.2, "rpm")
        waits = [(await _book(p2, itpm=10))[1] for _ in range(3)]
        assert waits == [pytest.approx(w, abs=60) for w in (300, 400, 500)]
        assert float(await r.hget(keys.pool_pacer(pool2), "itpm")) < float(await r.hget(keys.pool_pacer(pool2), "rpm"))

    _run(valkey_url, body)


def test_throttled_dimension():
    assert throttled_dimension({"anthropic-ratelimit-output-tokens-remaining": "0",
                                "anthropic-ratelimit-requests-remaining": "5"}, b"") == "otpm"
    assert throttled_dimension({"llm_provider-x-ratelimit-remaining-requests": "0"}, b"") == "rpm"
    assert throttled_dimension({}, b"exceed the rate limit of 40000 input tokens per minute") == "itpm"
    assert throttled_dimension({}, b"Rate limit reached for requests per min (RPM)") == "rpm"
    assert throttled_dimension({}, b"overloaded") is None


def test_script_reloads_after_script_flush(valkey_url, unique):
    """After a failover or SCRIPT FLUSH the SHA is gone: redis-py's Script reloads it (NOSCRIPT)."""
    pool = f"{unique}-pool"

    async def body(r):
        await r.hset(keys.pool_limits(pool), mapping={"rpm": 60000})
        p = ValkeyPacer(r, pool, burst_s=1.0)
        assert (await _book(p))[0] == 1
        await r.script_flush()
        assert (await _book(p))[0] == 1

    _run(valkey_url, body)
