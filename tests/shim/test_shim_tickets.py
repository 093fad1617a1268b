"""Tickets (shim/gate.py): a call's settle takes the next call's hold and pool booking ahead, so that call asks
Valkey nothing. Every call is still held and booked before it goes; nothing a ticket takes outlives it."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from shimtest import LOCAL_TOKEN

from contract import keys
from contract.models import AttemptRef
from shim.caps import ValkeyBudget
from shim.gate import Demand, Gate, Ticket
from shim.kv import KV
from shim.pacer import PaceRequest, ValkeyPacer

BODY = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "go"}]}


def _budget(valkey, key: str) -> dict[str, int]:
    h = valkey.hgetall(key)
    return {k.decode(): int(v) for k, v in h.items() if k in (b"spent", b"held")} | {
        "holds": sum(k.startswith(b"hold:") for k in h)}


def _post(s, body=BODY) -> httpx.Response:
    return httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=body, timeout=30)


def test_calls_after_the_first_go_on_tickets_and_nothing_is_left_held(sim, shim, valkey, unique):
    s = shim(sim(), limits={"cost_usd": 5.0}, run_cost_usd=50.0)
    for _ in range(5):
        assert _post(s).status_code == 200
    time.sleep(0.2)  # the last settle (and its ticket) is in the background
    st = s.status()
    assert st["tickets"]["used"] == 4 and st["tickets"]["taken"] == 5
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    live = _budget(valkey, keys.attempt_budget(ref))
    assert live["holds"] == 1 and live["held"] > 0  # the sixth call's ticket, waiting
    assert s.stop() == 0
    spent = sum(r["cost_usd"] for r in s.rows())
    for key in (keys.attempt_budget(ref), keys.run_budget(unique)):
        b = _budget(valkey, key)
        assert b["held"] == 0 and b["holds"] == 0  # the unused ticket was given back at shutdown
        assert abs(b["spent"] - spent * 1e6) <= 5  # micro-dollars, each call rounded up
    assert json.loads((s.dir / "status.json").read_text())["tickets"]["returned"] == 1  # written at exit


def test_a_ticket_books_the_pool_ahead_and_an_unused_one_is_refunded(sim, shim, valkey, unique):
    """rpm 60 with a 1 s burst: one call a second. The second call, on its ticket, still waits its turn;
    the shim's unused ticket is refunded, so the pool is booked for exactly the calls that were made."""
    pool = f"{unique}-pool"
    valkey.hset(keys.pool_limits(pool), mapping={"rpm": 60})
    s = shim(sim(), pacer_burst_s=1.0)
    t0 = time.monotonic()
    for _ in range(3):
        assert _post(s).status_code == 200
    elapsed = time.monotonic() - t0
    time.sleep(0.2)
    assert s.status()["tickets"]["used"] == 2
    waits = [r["pacer_wait_ms"] for r in s.rows()]
    assert waits[0] < 100 and all(800 <= w <= 1100 for w in waits[1:]) and elapsed >= 1.8
    tat_before = float(valkey.hget(keys.pool_pacer(pool), "rpm"))  # three calls and the waiting ticket
    assert s.stop() == 0
    tat_after = float(valkey.hget(keys.pool_pacer(pool), "rpm"))
    assert 990 <= tat_before - tat_after <= 1010  # the ticket's request (1 s at rpm 60) given back


def test_a_ticket_that_does_not_cover_the_call_is_given_back_in_the_same_round_trip(sim, shim, valkey, unique):
    s = shim(sim(), limits={"cost_usd": 5.0})
    assert _post(s).status_code == 200
    big = {**BODY, "messages": [{"role": "user", "content": "x " * 60_000}]}  # far past the ticket's size
    assert _post(s, big).status_code == 200
    assert _post(s).status_code == 200
    time.sleep(0.2)
    st = s.status()
    assert st["tickets"] == {"taken": 3, "used": 1, "returned": 1}  # the big call held anew
    if st["dataplane"] == "compiled":  # it served all three: the first and the big one on tickets it asked for
        assert st["dataplane_calls"] == 3 and st["dataplane_asks"] == 2
    assert s.stop() == 0
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    b = _budget(valkey, keys.attempt_budget(ref))
    assert b["held"] == 0 and b["holds"] == 0
    assert abs(b["spent"] - sum(r["cost_usd"] for r in s.rows()) * 1e6) <= 5


def test_an_unused_ticket_is_given_back_after_its_time(sim, shim, valkey, unique):
    s = shim(sim(), limits={"cost_usd": 5.0}, ticket_ttl_s=0.3)
    assert _post(s).status_code == 200
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    time.sleep(0.1)
    assert _budget(valkey, keys.attempt_budget(ref))["holds"] == 1
    time.sleep(1.0)  # past ticket_ttl_s: the shim's timer gives it back, without another call
    b = _budget(valkey, keys.attempt_budget(ref))
    assert b["held"] == 0 and b["holds"] == 0
    assert _post(s).status_code == 200  # and the next call holds anew
    time.sleep(0.2)
    assert s.status()["tickets"] == {"taken": 2, "used": 0, "returned": 1}


def test_no_tickets_near_the_run_cap(sim, shim, valkey, unique):
    """Tickets stop once the run's spent + held would pass ticket_room of its cap: calls there hold exactly
    their own worst case, as without tickets (a ticket never makes another attempt's call be refused)."""
    s = shim(sim(), run_cost_usd=0.05, ticket_room=0.1)  # a call holds ~0.75 mUSD; its ticket ~5 mUSD
    for _ in range(3):
        assert _post(s).status_code == 200
    time.sleep(0.2)
    assert s.status()["tickets"]["taken"] == 0 and s.status()["tickets"]["used"] == 0
    assert s.stop() == 0


def test_tickets_off(sim, shim, valkey, unique):
    s = shim(sim(), ticket_ttl_s=0)
    for _ in range(3):
        assert _post(s).status_code == 200
    time.sleep(0.2)
    assert s.status()["tickets"] == {"taken": 0, "used": 0, "returned": 0}


def test_tickets_run_ahead_while_calls_overlap_and_one_for_one_call_at_a_time():
    """Gate.tickets_wanted: never more tickets than calls in flight; one for a call alone; while calls overlap,
    up to two per answered call until there is one per call in flight (the next call should not find only the
    one just asked for, still a round trip away)."""
    kv = KV("redis://127.0.0.1:6379/0")  # never connects: nothing here is sent
    ref = AttemptRef(run="r", instance_id="repo__repo-1", attempt=1)
    gate = Gate(ValkeyBudget(kv, ref, 1.0, 10.0, 60), ValkeyPacer(kv, "p"), ticket_ttl_s=15)
    assert gate.tickets_wanted(1) == 1  # one call at a time: never a spare
    assert gate.tickets_wanted(3) == 2 and gate.tickets_wanted(16) == 2  # overlapping, none left: two
    loop = asyncio.new_event_loop()
    try:
        gate.tickets.append(loop.create_future())
        assert gate.tickets_wanted(1) == 0 and gate.tickets_wanted(2) == 1 and gate.tickets_wanted(4) == 2
        assert gate.tickets_wanted(3, lent=1) == 1  # lent: those the compiled data plane holds unused
        gate.tickets.extend([loop.create_future(), loop.create_future()])
        assert gate.tickets_wanted(3) == 0  # as many tickets as calls in flight
    finally:
        loop.close()
    assert Gate(ValkeyBudget(kv, ref, 1.0, 10.0, 60), ValkeyPacer(kv, "p"), ticket_ttl_s=0).tickets_wanted(3) == 0


def test_the_data_planes_demand_counts_its_peak_and_its_asks_while_calls_overlap():
    """Demand (the calls the compiled data plane's tickets cover): a harness making one call at a time is one call
    whatever it asks; overlapping calls count at their peak over the window, plus one per ask lately, halved each
    window and dropped once calls stop overlapping."""
    lone = Demand(window_s=1.0)
    for i in range(20):  # every call asks (its ticket expired while the harness worked): still one
        lone.asked()
        lone.ended(0, now=i * 0.3)
        assert lone.calls(1) == 1
    d = Demand(window_s=1.0)
    d.ended(5, now=0.0)
    d.ended(2, now=0.1)
    assert d.calls(3) == 6  # the peak (5 others and the one ending), not the calls in flight now
    assert d.calls(9) == 9
    for _ in range(4):
        d.asked()
    assert d.calls(3) == 10  # four short lately
    for _ in range(10):
        d.asked()
    assert d.calls(3) == 12  # at most twice the peak
    d.ended(1, now=1.05)  # a new window: the peak starts again, the asks count half
    assert d.calls(1) == 2 + 2  # (14 short, capped at 64, halved to 7; counted up to the peak)
    d.ended(0, now=2.1)  # calls no longer overlap: no asks counted
    assert d.calls(1) == 1


def test_a_call_no_larger_than_its_ticket_is_covered_without_pricing_it():
    """Gate.hold asks for the call's worst case (need()) only when the ticket's size does not settle it: a call
    with no more request bytes and max output than the ticket was sized for is covered as it is; a call larger
    by one measure, or on a ticket without a size, is priced, and covered because its cost fits."""
    kv = KV("redis://127.0.0.1:6379/0")  # never connects: every call here goes on a ticket
    ref = AttemptRef(run="r", instance_id="repo__repo-1", attempt=1)
    gate = Gate(ValkeyBudget(kv, ref, 1.0, 10.0, 60), ValkeyPacer(kv, "p"), ticket_ttl_s=15)
    pace = PaceRequest("p", 100, 50)
    priced: list[int] = []

    def need(cost: int):
        def f():
            priced.append(cost)
            return cost, pace
        return f

    async def main() -> list:
        out = []
        # (the call's size, its cost if priced, the ticket's size); every ticket holds 1000
        for size, cost, ticket_size in (((1000, 50), 10**9, (1000, 50)), ((1000, 60), 500, (1000, 50)),
                                        ((900, 50), 800, None)):
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(Ticket("t", 1000, pace, ticket_size, False, 0.0, time.monotonic() + 15))
            gate.tickets.append(fut)
            out.append(await gate.hold("c", need(cost), size))
        return out

    gated = asyncio.run(main())
    assert [(g.which, g.hold_id) for g in gated] == [(0, "t")] * 3  # all three on their tickets
    assert priced == [500, 800]  # the first (no larger than its ticket) never priced: 10**9 would not fit
    assert gate.stats["used"] == 3


def test_overlapping_calls_leave_nothing_held(sim, shim, valkey, unique):
    """Four callers at once, three calls each, back to back (spare tickets are asked for): every call is
    answered, at most twice as many tickets as callers go unused (Demand: the peak of calls in flight, and as
    many again for the calls that had to ask), and shutdown gives every ticket back."""
    s = shim(sim(ttft_ms=50), limits={"cost_usd": 5.0}, run_cost_usd=50.0)
    with ThreadPoolExecutor(4) as ex:
        codes = list(ex.map(lambda _: [_post(s).status_code for _ in range(3)], range(4)))
    assert codes == [[200] * 3] * 4
    time.sleep(0.2)
    st = s.status()["tickets"]
    # (calls after a caller's first mostly go on tickets; how many depends on timing: on a slow VM, with the
    # Python data plane, 5 of the 8 did once. That calls go on tickets:
    # test_calls_after_the_first_go_on_tickets_and_nothing_is_left_held)
    assert st["used"] >= 4 and st["taken"] - st["used"] - st["returned"] <= 2 * 4
    assert s.stop() == 0
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    for key in (keys.attempt_budget(ref), keys.run_budget(unique)):
        b = _budget(valkey, key)
        assert b["held"] == 0 and b["holds"] == 0
        assert abs(b["spent"] - sum(r["cost_usd"] for r in s.rows()) * 1e6) <= 10


def test_the_after_call_script_does_what_the_separate_commands_did(valkey, valkey_url, unique):
    """Gate.after_cmd (one script: budget settle, pool settle, progress, tickets) against the commands it
    replaced (each script alone, HSET and EXPIRE), on two copies of the same state: the same budgets, holds,
    progress and ticket answers (one ticket that fits, one the attempt cap refuses), pool TATs alike up to the
    time between the two (< 100 ms), and nothing else written."""
    from shim.progress import Progress

    def side(tag: str):
        ref = AttemptRef(run=f"{unique}{tag}", instance_id="repo__repo-1", attempt=1)
        valkey.hset(keys.pool_limits(f"{unique}{tag}-pool"), mapping={"rpm": 600, "itpm": 10**6, "otpm": 10**5})
        budget = ValkeyBudget(kv, ref, 1.0, 10.0, 60)
        pacer = ValkeyPacer(kv, f"{unique}{tag}-pool")
        return ref, budget, pacer, Gate(budget, pacer, ticket_ttl_s=15), Progress(kv, ref, f"{unique}{tag}-pool")

    kv = KV(valkey_url)
    pace, fields = PaceRequest("p", 2000, 500), {"calls": 1, "turns": 1, "cost_usd": "0.012000000", "stopped": ""}

    async def main():
        out = []
        for tag in ("a", "b"):
            ref, budget, pacer, gate, progress = side(tag)
            (first,) = await kv.pipeline([gate._hold_admit("c1", 40_000, pace)])
            assert list(first[:3]) == [1, 0, 1]
            if tag == "a":  # what _after sent before: each part on its own
                cmds = [pacer.settle_cmd(pace, 1500, 120), budget.settle_cmd("c1", 12_000), *progress.cmds(fields),
                        gate._hold_admit("t-c1", 60_000, pace, gate.run_room),
                        gate._hold_admit("t1-c1", 2_000_000, pace, gate.run_room)]
                replies = await kv.pipeline(cmds)
                tickets = [list(r) for r in replies[-2:]]
            else:
                targs = [gate.ticket_args("t-c1", 60_000, pace)[0], gate.ticket_args("t1-c1", 2_000_000, pace)[0]]
                (reply,) = await kv.pipeline([gate.after_cmd("c1", 12_000, ValkeyPacer.settle_args(pace, 1500, 120),
                                                             progress.update(fields), targs)])
                tickets = [list(r) for r in reply]
            out.append((ref, tickets))
        await kv.aclose()
        return out

    (ref_a, tickets_a), (ref_b, tickets_b) = asyncio.run(main())
    assert tickets_a == tickets_b == [[1, 0, 1, 0], [0, 1, 0, 0]]  # the second: over the $1 attempt cap

    def state(tag: str, ref: AttemptRef) -> dict:
        ab, rb = keys.attempt_budget(ref), keys.run_budget(ref.run)
        return {"attempt": valkey.hgetall(ab), "run": valkey.hgetall(rb),
                "attempt holds": valkey.zrange(ab + ":exp", 0, -1), "run holds": valkey.zrange(rb + ":exp", 0, -1),
                "progress": valkey.hgetall(keys.progress(ref)),
                "ttls": [valkey.ttl(k) > 0 for k in (ab, rb, keys.progress(ref))]}

    a, b = state("a", ref_a), state("b", ref_b)
    assert a == b
    assert a["attempt"][b"spent"] == b"12000" and a["attempt"][b"held"] == b"60000"
    assert a["attempt holds"] == [b"t-c1"] and a["progress"][b"cost_usd"] == b"0.012000000"
    pa = {k: float(v) for k, v in valkey.hgetall(keys.pool_pacer(f"{unique}a-pool")).items()}
    pb = {k: float(v) for k, v in valkey.hgetall(keys.pool_pacer(f"{unique}b-pool")).items()}
    assert pa.keys() == pb.keys() == {b"rpm", b"itpm", b"otpm"}
    assert all(abs(pa[k] - pb[k]) < 100 for k in pa)  # the settle moved otpm by 228 ms: not lost in this
    assert sorted(k.decode().replace(f"{unique}b", f"{unique}a") for k in valkey.scan_iter(match=f"*{unique}b*")) \
        == sorted(k.decode() for k in valkey.scan_iter(match=f"*{unique}a*"))
