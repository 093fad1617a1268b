"""A call's Valkey round trips (shim/admission.py), against the real Valkey: the budget hold and the first
attempt's pool admission in one script before it goes, the settles and the progress hash in one script after
it; and, through the shim, every call held and booked before it goes and nothing left held after."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from shimtest import LOCAL_TOKEN

from contract import keys
from contract.models import AttemptRef
from shim.admission import Gate
from shim.caps import ATTEMPT_CAP, RUN_CAP, ValkeyBudget
from shim.config import ShimConfig
from shim.pacer import PaceRequest, PastDeadline, ValkeyPacer
from shim.progress import SessionProgress
from shim.server import Shim

BODY = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "go"}]}


def _gate(r, unique: str, acap: float | None, rcap: float | None, max_wait_s: float = 60.0):
    ref = AttemptRef(run=unique, instance_id="a", attempt=1)
    budget = ValkeyBudget(r, ref, acap, rcap, 60.0)
    pacer = ValkeyPacer(r, f"{unique}-pool", burst_s=1.0, max_wait_s=max_wait_s)
    return Gate(budget, pacer, SessionProgress(r, ref, f"{unique}-pool"), r), budget, pacer


def _budget(valkey, key: str) -> dict[str, int]:
    h = valkey.hgetall(key)
    return {k.decode(): int(v) for k, v in h.items() if k in (b"spent", b"held")} | {
        "holds": sum(k.startswith(b"hold:") for k in h)}


def test_the_hold_and_the_admission_are_one_script(valkey_url, valkey, unique):
    valkey.hset(keys.pool_limits(f"{unique}-pool"), mapping={"rpm": 60})  # one a second, burst of one

    async def main():
        r = aioredis.Redis.from_url(valkey_url)
        gate, budget, _ = _gate(r, unique, acap=0.0001, rcap=None)
        assert gate.combined
        req = PaceRequest(f"{unique}-pool", 10, 10)
        assert await gate.hold("c1", 60, req) == (0, 0.0)  # held, admitted at once
        t0 = time.monotonic()
        which, waited = await gate.hold("c2", 30, req)  # held, booked a second ahead, slept it
        assert which == 0 and 900 <= waited <= 1000 and time.monotonic() - t0 >= 0.85
        tat = valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm")
        # the attempt cap (100 micro-dollars) has 10 left: refused, and the pool's booking is untouched
        assert await gate.hold("c3", 20, req) == (ATTEMPT_CAP, 0.0)
        assert valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm") == tat
        h = valkey.hgetall(keys.attempt_budget(AttemptRef(run=unique, instance_id="a", attempt=1)))
        assert int(h[b"held"]) == 90 and b"hold:c3" not in h
        await budget.settle("c1", 50)
        await budget.settle("c2", 0)
        h = valkey.hgetall(keys.attempt_budget(AttemptRef(run=unique, instance_id="a", attempt=1)))
        assert int(h[b"held"]) == 0 and int(h[b"spent"]) == 50
        await r.aclose()

    asyncio.run(main())


def test_a_hold_asked_again_is_taken_once(valkey_url, valkey, unique):
    """The shim asks again when the store's answer did not come back (a timeout after the script ran): the second
    ask of the same id holds nothing more, and its settle leaves nothing held."""
    async def main():
        r = aioredis.Redis.from_url(valkey_url)
        gate, budget, _ = _gate(r, unique, acap=0.001, rcap=0.002)
        req = PaceRequest(f"{unique}-pool", 10, 10)
        assert (await gate.hold("c1", 600, req))[0] == 0
        assert (await gate.hold("c1", 600, req))[0] == 0  # asked again: 1,200 would not fit under the 1,000 cap
        ref = AttemptRef(run=unique, instance_id="a", attempt=1)
        assert _budget(valkey, keys.attempt_budget(ref)) == {"held": 600, "holds": 1}
        await budget.settle("c1", 400)
        assert _budget(valkey, keys.attempt_budget(ref)) == {"held": 0, "spent": 400, "holds": 0}
        await r.aclose()

    asyncio.run(main())


def test_a_budget_hold_that_fails_for_a_moment_is_asked_again_not_refused(tmp_path):
    """Valkey unreachable for a moment (a restart, a host under load) when a call arrives: the shim asks for the
    call's hold again, within store_wait_s, and only past it answers that the store is unavailable."""
    cfg = ShimConfig(upstream_url="http://upstream.invalid", provider="anthropic", model="claude-sonnet-4-5",
                     pool="p", ref=AttemptRef(run="r", instance_id="a__b-1", attempt=1), local_token="t",
                     ledger_path=tmp_path / "ledger.jsonl", backoff_base_s=0.01, backoff_cap_s=0.05, store_wait_s=1.0)
    asked: list[str] = []

    class FlakyGate:
        def __init__(self, failures: int):
            self.failures = failures

        async def hold(self, hold_id, est, pace, deadline=None):
            asked.append(hold_id)
            if len(asked) <= self.failures:
                raise redis.exceptions.ConnectionError("Connection refused")
            return 0, 0.0

    s = Shim(cfg, None)
    s.gate = FlakyGate(failures=3)
    assert asyncio.run(s._hold_budget("c1", 10, PaceRequest("p", 1, 1))) == (0, 0.0)
    assert asked == ["c1"] * 4
    asked.clear()
    s.gate = FlakyGate(failures=10_000)
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        asyncio.run(s._hold_budget("c2", 10, PaceRequest("p", 1, 1)))
    assert len(asked) > 3 and time.monotonic() - t0 <= 1.0 + 0.1


def test_refusal_by_the_run_cap_far_bookings_and_the_wall_time(valkey_url, valkey, unique):
    valkey.hset(keys.pool_limits(f"{unique}-pool"), mapping={"rpm": 60})

    async def main():
        r = aioredis.Redis.from_url(valkey_url)
        gate, _, pacer = _gate(r, unique, acap=None, rcap=0.00005, max_wait_s=0.5)
        req = PaceRequest(f"{unique}-pool", 0, 0)
        assert await gate.hold("r1", 50, req) == (0, 0.0)
        assert (await gate.hold("r2", 1, req))[0] == RUN_CAP
        # a second gate on another run: held, but the pool is booked further ahead than max_wait: it sleeps
        # until the booking fits and asks ADMIT again (ValkeyPacer.admitted)
        gate2, _, pacer2 = _gate(r, unique + "b", acap=None, rcap=None, max_wait_s=0.5)
        gate2.keys[4:] = pacer2.keys = pacer.keys  # the same pool
        t0 = time.monotonic()
        which, waited = await gate2.hold("x1", 0, req)
        assert which == 0 and 900 <= waited <= 1100 and time.monotonic() - t0 >= 0.85
        # a wait that would pass the attempt's wall time: refused, and nothing stays booked
        tat = valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm")
        with pytest.raises(PastDeadline):
            await gate2.hold("x2", 0, req, deadline=time.monotonic() + 0.3)
        assert valkey.hget(keys.pool_pacer(f"{unique}-pool"), "rpm") == tat
        await r.aclose()

    asyncio.run(main())
    valkey.delete(*valkey.keys(f"*{unique}b*") or [f"{unique}b:none"])


def test_the_after_call_script_does_what_the_separate_commands_do(valkey, valkey_url, unique):
    """Gate.after (one script: budget settle, pool settle, progress) against the same steps one by one (a gate
    that is not combined), on two copies of the same state: the same budgets, holds and progress, pool TATs
    alike up to the time between the two (< 100 ms), and nothing else written."""
    pace = PaceRequest("p", 2000, 500)
    fields = {"calls": 1, "turns": 1, "cost_usd": "0.012000000", "stopped": ""}

    async def main():
        r = aioredis.Redis.from_url(valkey_url)
        refs = []
        for tag in ("a", "b"):
            valkey.hset(keys.pool_limits(f"{unique}{tag}-pool"), mapping={"rpm": 600, "itpm": 10**6, "otpm": 10**5})
            gate, _, _ = _gate(r, f"{unique}{tag}", 1.0, 10.0)
            assert await gate.hold("c1", 40_000, pace) == (0, 0.0)
            if tag == "a":
                gate.combined = False
            await gate.after([("c1", 12_000, pace, 1500, 120)], fields)
            refs.append(AttemptRef(run=f"{unique}{tag}", instance_id="a", attempt=1))
        await r.aclose()
        return refs

    ref_a, ref_b = asyncio.run(main())

    def state(ref: AttemptRef) -> dict:
        ab, rb = keys.attempt_budget(ref), keys.run_budget(ref.run)
        return {"attempt": valkey.hgetall(ab), "run": valkey.hgetall(rb),
                "attempt holds": valkey.zrange(ab + ":exp", 0, -1), "run holds": valkey.zrange(rb + ":exp", 0, -1),
                "progress": valkey.hgetall(keys.progress(ref)),
                "ttls": [valkey.ttl(k) > 0 for k in (ab, rb, keys.progress(ref))]}

    a, b = state(ref_a), state(ref_b)
    assert a == b
    assert a["attempt"][b"spent"] == b"12000" and a["attempt"][b"held"] == b"0" and a["attempt holds"] == []
    assert a["progress"][b"cost_usd"] == b"0.012000000" and all(a["ttls"])
    pa = {k: float(v) for k, v in valkey.hgetall(keys.pool_pacer(f"{unique}a-pool")).items()}
    pb = {k: float(v) for k, v in valkey.hgetall(keys.pool_pacer(f"{unique}b-pool")).items()}
    assert pa.keys() == pb.keys() == {b"rpm", b"itpm", b"otpm"}
    assert all(abs(pa[k] - pb[k]) < 100 for k in pa)  # the settle moved otpm by 228 ms: not lost in this
    assert sorted(k.decode().replace(f"{unique}b", f"{unique}a") for k in valkey.scan_iter(match=f"*{unique}b*")) \
        == sorted(k.decode() for k in valkey.scan_iter(match=f"*{unique}a*"))


def _post(s, body=BODY) -> httpx.Response:
    return httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=body, timeout=30)


@pytest.mark.alone  # each wait within 100 ms of the pacer's second
def test_every_call_waits_its_turn_with_the_pool(sim, shim, valkey, unique):
    """rpm 60 with a 1 s burst: one call a second, each booked before it goes; the pool is booked for exactly
    the calls that were made."""
    pool = f"{unique}-pool"
    valkey.hset(keys.pool_limits(pool), mapping={"rpm": 60})
    s = shim(sim(), pacer_burst_s=1.0)
    t0 = time.monotonic()
    for _ in range(3):
        assert _post(s).status_code == 200
    elapsed = time.monotonic() - t0
    waits = [r["pacer_wait_ms"] for r in s.rows()]
    assert waits[0] < 100 and all(800 <= w <= 1100 for w in waits[1:]) and elapsed >= 1.8
    tat = float(valkey.hget(keys.pool_pacer(pool), "rpm"))
    assert s.stop() == 0
    assert float(valkey.hget(keys.pool_pacer(pool), "rpm")) == tat  # nothing booked ahead to give back


def test_overlapping_calls_leave_nothing_held(sim, shim, valkey, unique):
    """Four callers at once, three calls each: every call is answered; status counts them in flight until their
    rows and settles are done; afterwards nothing is held and what was spent is what the ledger says."""
    s = shim(sim(ttft_ms=300), limits={"cost_usd": 5.0}, run_cost_usd=50.0)
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(lambda: [_post(s).status_code for _ in range(3)]) for _ in range(4)]
        seen = set()
        while not all(f.done() for f in futures):
            seen.add(s.status()["in_flight"])
            time.sleep(0.05)
        codes = [f.result() for f in futures]
    assert max(seen) >= 1
    assert codes == [[200] * 3] * 4
    rows = s.rows()  # read the moment status says in_flight 0
    assert len(rows) == 12 and s.status()["ledger_rows"] == 12
    assert s.stop() == 0
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    for key in (keys.attempt_budget(ref), keys.run_budget(unique)):
        b = _budget(valkey, key)
        assert b["held"] == 0 and b["holds"] == 0
        assert abs(b["spent"] - sum(r["cost_usd"] for r in rows) * 1e6) <= 12  # micro-dollars, each rounded up
