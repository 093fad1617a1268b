"""A run's call hold (`pause --hold-calls`) through the shim: a new call waits in the shim until the hold is lifted
(a call already upstream finishes), its ledger row says how long, and the attempt's wall time does not run while it
waits."""

from __future__ import annotations

import threading
import time

import anthropic
import pytest

from shim.hold import set_hold

ASK = {"model": "harness-model", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}


def test_a_held_run_holds_new_calls_until_resumed_and_not_against_its_wall_time(sim, shim, valkey):
    url = sim(ttft_ms=800)  # a call takes 0.8 s upstream: one can be there when the hold is set
    s = shim(url, limits={"wall_time_s": 1.0}, hold_poll_s=0.05)
    a, run = s.anthropic(), s.cfg.ref.run
    answers: dict[str, object] = {}

    def ask(name: str) -> threading.Thread:
        t = threading.Thread(target=lambda: answers.__setitem__(name, a.messages.create(**ASK)))
        t.start()
        return t

    try:
        upstream = ask("upstream")
        time.sleep(0.3)
        set_hold(valkey, run, True)
        time.sleep(0.2)  # past the shim's hold_poll_s: a new call sees the hold
        t0 = time.monotonic()
        held = ask("held")
        upstream.join(timeout=10)
        assert "upstream" in answers  # already upstream: it finished under the hold
        time.sleep(2.5)
        assert "held" not in answers  # still waiting in the shim ...
        st = s.status()
        assert st["in_flight"] == 1 and st["stopped"] is None
        # ... and the task's wall-time guard (harness/task.py: deadline + status held_s) counts it while it waits:
        # longer already than the attempt's 1 s wall time
        assert st["held_s"] >= 2.4
    finally:
        set_hold(valkey, run, False)
    held.join(timeout=10)
    took = time.monotonic() - t0
    assert answers["held"].content[0].text and took >= 2.5
    answers["after"] = a.messages.create(**ASK)  # the hold is lifted: not held

    rows = {r["call_id"]: r for r in s.rows()}
    assert [r["outcome"] for r in rows.values()] == ["ok"] * 3
    held_ms = sorted(r["held_ms"] for r in rows.values())
    assert held_ms[:2] == [0, 0]  # the call already upstream and the one after the resume
    assert 2500 <= held_ms[2] <= took * 1000 + 50  # the held call, as long as it waited
    st = s.status()
    assert st["stopped"] is None  # past the 1 s wall time by the held time, and not ended by it
    assert abs(st["held_s"] * 1000 - held_ms[2]) < 5


def test_a_call_held_when_the_shim_stops_still_lands_its_ledger_row(sim, shim, valkey):
    """SIGTERM while a call is held (a task stopped during a pause or an outage) whose harness already hung up (its
    own timeout, or killed with the task): aiohttp no longer follows that request, and the call still lands its
    row (cancelled, with the time it was held) before the ledger closes."""
    s = shim(sim(), hold_poll_s=0.05)
    a, run = s.anthropic(timeout=1.0), s.cfg.ref.run  # the harness gives up after a second
    set_hold(valkey, run, True)
    try:
        with pytest.raises(anthropic.APITimeoutError):
            a.messages.create(**ASK)
        deadline = time.monotonic() + 30  # a bound for a loaded machine, not a measure
        while not (st := s.status())["held_s"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st["in_flight"] == 1 and st["held_s"] > 0  # still held in the shim, nobody waiting for it
        assert s.stop() == 0
    finally:
        set_hold(valkey, run, False)
    (row,) = s.rows()
    assert row["outcome"] == "cancelled" and row["held_ms"] > 0 and row["http_status"] == 0  # never answered


def test_a_call_stuck_past_its_cancellation_at_shutdown_still_lands_one_row(tmp_path, caplog):
    """A handler that does not end when the shutdown cancels it (an await that swallows the cancellation: here a
    hold gate) gets its row from stop() all the same, with a warning; when it ends later, no second row."""
    import asyncio
    import json

    import aiohttp

    from contract.models import AttemptRef
    from shim.config import ShimConfig
    from shim.server import Shim

    cfg = ShimConfig(upstream_url="http://upstream.invalid", provider="anthropic", model="claude-sonnet-4-5",
                     pool="p", ref=AttemptRef(run="r", instance_id="a__b-1", attempt=1), local_token="t",
                     ledger_path=tmp_path / "ledger.jsonl", shutdown_timeout_s=0.3)

    class StuckHold:
        """The run's hold: set at first, then read again by an await that ignores one cancellation and waits to
        be let go (then: not held, None)."""
        poll_s = 0.05

        def __init__(self):
            self.entered, self.release = asyncio.Event(), asyncio.Event()

        async def probe(self):
            return False

        async def open_for_s(self, fresh=False):
            if not fresh:
                return 0.0
            self.entered.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
            await self.release.wait()

    async def main():
        s = Shim(cfg, None)
        port = await s.start()
        s.run_hold = stuck = StuckHold()
        async with aiohttp.ClientSession() as http:
            ask = asyncio.create_task(http.post(f"http://127.0.0.1:{port}/v1/messages", json=ASK,
                                                headers={"x-api-key": "t"}))
            await asyncio.wait_for(stuck.entered.wait(), 10)
            ask.cancel()  # the harness hangs up
            with caplog.at_level("WARNING", logger="shim"):
                assert await s.stop() is True
            rows = [json.loads(x) for x in cfg.ledger_path.read_text().splitlines()]
            assert [(r["outcome"], r["route"]) for r in rows] == [("cancelled", "/v1/messages")]
            assert rows[0]["held_ms"] > 0 and rows[0]["http_status"] == 0  # held until then, never answered
            assert "had not ended 0.3 s after it was cancelled" in caplog.text
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            stuck.release.set()  # the stuck handler goes on (to an upstream the closed shim cannot reach) and ends
            await asyncio.wait(handlers, timeout=10)
        assert len(cfg.ledger_path.read_text().splitlines()) == 1

    asyncio.run(main())
