"""The shim's own Valkey client (shim/kv.py) and the one round trip before forwarding (shim/gate.py), against
the real Valkey."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from contract import keys
from contract.models import AttemptRef
from shim.caps import ATTEMPT_CAP, RUN_CAP, ValkeyBudget
from shim.gate import Gate
from shim.kv import KV, ReplyError, Script, as_kv
from shim.pacer import PaceRequest, ValkeyPacer


def _run(coro):
    return asyncio.run(coro)


def test_commands_pipelines_and_errors(valkey_url, valkey, unique):
    async def main():
        kv = KV(valkey_url)
        assert await kv.execute("SET", f"{unique}:a", 5) == b"OK"
        assert await kv.execute("INCRBY", f"{unique}:a", 2) == 7
        replies = await kv.pipeline([("INCR", f"{unique}:a"), ("HSET", f"{unique}:a", "f", 1), ("GET", f"{unique}:a")])
        assert replies[0] == 8 and isinstance(replies[1], ReplyError) and replies[2] == b"8"  # error in its slot
        with pytest.raises(ReplyError):
            await kv.execute("HSET", f"{unique}:a", "f", 1)
        # a transaction: both or nothing
        assert await kv.pipeline([("HSET", f"{unique}:h", "x", "1"), ("EXPIRE", f"{unique}:h", 60)],
                                 transaction=True) == [1, 1]
        # many concurrent callers share the one connection; replies go to the right caller
        got = await asyncio.gather(*(kv.execute("ECHO", str(i)) for i in range(500)))
        assert got == [str(i).encode() for i in range(500)]
        await kv.aclose()

    _run(main())
    assert valkey.ttl(f"{unique}:h") > 0


def test_scripts_reload_after_flush(valkey_url, valkey, unique):
    async def main():
        kv = KV(valkey_url)
        s = kv.register(Script(f"return redis.call('INCR', KEYS[1]) + 0 -- {unique}"))
        assert await kv.script(s, [f"{unique}:n"], []) == 1
        valkey.script_flush()
        assert await kv.script(s, [f"{unique}:n"], []) == 2  # NOSCRIPT -> EVAL
        valkey.script_flush()
        assert await kv.pipeline([s.cmd([f"{unique}:n"], []), ("GET", f"{unique}:n")]) == [3, b"2"]
        await kv.aclose()

    _run(main())


def test_deferred_commands_ride_along_or_go_alone(valkey_url, valkey, unique):
    async def main():
        kv = KV(valkey_url, defer_s=0.2)
        await kv.execute("PING")
        t0 = time.monotonic()
        alone = asyncio.ensure_future(kv.pipeline([("INCR", f"{unique}:d")], defer=True))
        assert (await alone) == [1] and time.monotonic() - t0 >= 0.15  # waited for its timer
        deferred = asyncio.ensure_future(kv.pipeline([("INCR", f"{unique}:d")], defer=True))
        await asyncio.sleep(0.01)
        assert not deferred.done()
        t0 = time.monotonic()
        assert await kv.execute("GET", f"{unique}:d") == b"2"  # the deferred INCR went first, in the same write
        assert (await deferred) == [2] and time.monotonic() - t0 < 0.15
        await kv.aclose()

    _run(main())


def test_reconnects_after_the_connection_is_killed(valkey_url, valkey, unique):
    async def main():
        kv = KV(valkey_url)
        await kv.execute("CLIENT", "SETNAME", unique)
        killed = [valkey.client_kill_filter(_id=c["id"]) for c in valkey.client_list() if c.get("name") == unique]
        assert killed == [1]
        await asyncio.sleep(0.05)
        assert await kv.execute("PING") in (b"PONG", "PONG")  # a new connection, transparently
        await kv.aclose()

    _run(main())


def test_url_database_and_errors(valkey_url, valkey, unique):
    async def main():
        kv = KV(valkey_url.rsplit("/", 1)[0] + "/3")
        await kv.execute("SET", f"{unique}:db3", 1)
        await kv.aclose()
        with pytest.raises(ValueError):
            KV("http://127.0.0.1:6379")
        dead = KV("redis://127.0.0.1:1/0", connect_timeout_s=0.5, retries=1)
        with pytest.raises((ConnectionError, OSError, TimeoutError)):
            await dead.execute("PING")

    _run(main())
    import redis

    r3 = redis.Redis.from_url(valkey_url.rsplit("/", 1)[0] + "/3")
    assert r3.get(f"{unique}:db3") == b"1" and valkey.get(f"{unique}:db3") is None
    r3.delete(f"{unique}:db3")
    r3.close()


# ------------------------------------------------------------------ the gate: HOLD+ADMIT in one script


def _gate(kv, unique: str, acap: float | None, rcap: float | None, rpm: int, max_wait_s: float = 60.0):
    ref = AttemptRef(run=unique, instance_id="a", attempt=1)
    budget = ValkeyBudget(kv, ref, acap, rcap, 60.0)
    pacer = ValkeyPacer(kv, f"{unique}-pool", burst_s=1.0, max_wait_s=max_wait_s)
    return Gate(budget, pacer), budget, pacer


@pytest.mark.parametrize("client", ["kv", "redis-py"])
def test_gate_holds_and_admits_in_one_script(valkey_url, valkey, unique, client):
    valkey.hset(keys.pool_limits(f"{unique}-pool"), mapping={"rpm": 60})  # one a second, burst of one

    async def main():
        kv = KV(valkey_url) if client == "kv" else as_kv(aioredis.Redis.from_url(valkey_url))
        gate, budget, _ = _gate(kv, unique, acap=0.0001, rcap=None, rpm=60)
        assert gate.combined
        req = PaceRequest(f"{unique}-pool", 10, 10)
        assert await gate.hold("c1", lambda: (60, req)) == (0, True, 0.0, True, "c1", req)  # held, admitted at once
        which, ok, wait_ms, answered, _, _ = await gate.hold("c2", lambda: (30, req))  # held, booked a second ahead
        assert (which, ok, answered) == (0, True, True) and 900 <= wait_ms <= 1000
        tat = valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm")
        # the attempt cap (100 micro-dollars) has 10 left: refused, and the pool's booking is untouched
        assert await gate.hold("c3", lambda: (20, req)) == (ATTEMPT_CAP, False, 0.0, False, "c3", req)
        assert valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm") == tat
        h = valkey.hgetall(keys.attempt_budget(AttemptRef(run=unique, instance_id="a", attempt=1)))
        assert int(h[b"held"]) == 90 and b"hold:c3" not in h
        await budget.settle("c1", 50)
        await budget.settle("c2", 0)
        h = valkey.hgetall(keys.attempt_budget(AttemptRef(run=unique, instance_id="a", attempt=1)))
        assert int(h[b"held"]) == 0 and int(h[b"spent"]) == 50
        await kv.aclose()

    _run(main())


def test_gate_refusal_by_run_cap_and_far_bookings(valkey_url, valkey, unique):
    valkey.hset(keys.pool_limits(f"{unique}-pool"), mapping={"rpm": 60})

    async def main():
        kv = KV(valkey_url)
        gate, _, pacer = _gate(kv, unique, acap=None, rcap=0.00005, rpm=60, max_wait_s=0.5)
        req = PaceRequest(f"{unique}-pool", 0, 0)
        assert await gate.hold("r1", lambda: (50, req)) == (0, True, 0.0, True, "r1", req)
        assert (await gate.hold("r2", lambda: (1, req)))[0] == RUN_CAP
        assert valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm") is not None
        # a second gate on another run: held, but the pool is booked further ahead than max_wait: not booked;
        # the caller sleeps until it fits and asks ADMIT again (ValkeyPacer.admitted)
        gate2, _, pacer2 = _gate(kv, unique + "b", acap=None, rcap=None, rpm=60, max_wait_s=0.5)
        gate2.keys[4:] = pacer2.keys = pacer.keys  # the same pool
        tat = valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm")
        which, ok, wait_ms, answered, _, _ = await gate2.hold("x1", lambda: (0, req))  # the pool is booked ~1 s ahead
        assert which == 0 and answered and not ok and wait_ms > 500
        assert valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm") == tat  # nothing booked
        t0 = time.monotonic()
        waited = await pacer2.admitted(req, ok, wait_ms)  # sleeps until it fits, books, sleeps the rest
        assert 900 <= waited <= 1100 and time.monotonic() - t0 >= 0.85
        assert valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm") != tat
        await kv.aclose()

    _run(main())
    valkey.delete(*valkey.keys(f"*{unique}b*") or [f"{unique}b:none"])
