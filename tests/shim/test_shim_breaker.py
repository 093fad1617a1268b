"""The pool's outage breaker in Valkey: what trips it, what keeps it closed, probes one at a time, a success
closes it."""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis

from shim.breaker import Breaker, open_for_s


def _run(valkey_url, body):
    async def main():
        r = aioredis.Redis.from_url(valkey_url)
        try:
            return await body(r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def test_a_sustained_streak_trips_it_and_a_success_closes_it(valkey_url, unique):
    async def body(r):
        b = Breaker(r, unique, threshold=3, window_s=0.3, probe_s=0.05, poll_s=0)
        seen = [await b.failed() for _ in range(3)]  # enough failures, but not yet for the window
        await asyncio.sleep(0.5)  # longer than window + 3 probes: the streak has expired and starts again
        seen.append(await b.failed())
        for _ in range(3):
            await asyncio.sleep(0.12)  # sparser than ... but one streak
            seen.append(await b.failed())
        opened = await b.open_for_s()
        ttl = await r.pttl(b.keys[0])
        sync = open_for_s(redis.Redis.from_url(valkey_url), unique)
        was = await b.ok()
        return seen, opened, sync, was, await b.open_for_s(), ttl

    seen, opened, sync, was, after, ttl = _run(valkey_url, body)
    assert 0 < ttl <= 300 + 3 * 50  # an open breaker nobody probes any more goes by itself
    assert seen[:6] == [None] * 6
    assert seen[6] is not None and seen[6] < 0.1  # tripped at the 4th failure of a streak lasting > 0.3 s
    assert opened is not None and sync is not None
    assert was is True and after is None


def test_a_success_between_failures_keeps_it_closed(valkey_url, unique):
    async def body(r):
        b = Breaker(r, unique, threshold=2, window_s=0.1, probe_s=0.2, poll_s=0)
        out = []
        for _ in range(5):
            out.append(await b.failed())
            await asyncio.sleep(0.06)
            await b.ok()
        return out

    assert _run(valkey_url, body) == [None] * 5


def test_one_probe_at_a_time_and_not_before_probe_s(valkey_url, unique):
    async def body(r):
        shims = [Breaker(r, unique, threshold=1, window_s=0, probe_s=0.3, poll_s=0) for _ in range(3)]
        closed_probe = await shims[0].probe()
        await shims[0].failed()
        early = [await b.probe() for b in shims]
        await asyncio.sleep(0.32)
        t = time.monotonic()
        turns = [await b.probe() for b in shims]
        return closed_probe, early, turns, time.monotonic() - t

    closed_probe, early, turns, _ = _run(valkey_url, body)
    assert closed_probe is False  # a closed breaker needs no probe
    assert early == [False] * 3  # the trip's own failure counts as the first probe
    assert turns == [True, False, False]


def test_a_cached_state_is_read_again_after_poll_s(valkey_url, unique):
    async def body(r):
        a = Breaker(r, unique, threshold=1, window_s=0, poll_s=0.2)
        b = Breaker(r, unique, threshold=1, window_s=0, poll_s=0.2)
        before = await b.open_for_s()
        await a.failed()
        cached = await b.open_for_s()
        await asyncio.sleep(0.21)
        return before, cached, await b.open_for_s(), await b.open_for_s(fresh=True)

    before, cached, later, fresh = _run(valkey_url, body)
    assert before is None and cached is None
    assert later is not None and fresh is not None


def test_a_young_streak_may_yet_trip_an_old_one_not(valkey_url, unique):
    async def body(r):
        b = Breaker(r, unique, threshold=50, window_s=0.2, poll_s=0)
        await b.failed()
        young = b.may_trip()
        for _ in range(2):  # each within the window of the last: one streak, older than the window at the end
            await asyncio.sleep(0.12)
            await b.failed()
        old = b.may_trip()
        await b.ok()
        return young, old, b.may_trip()

    assert _run(valkey_url, body) == (True, False, False)
