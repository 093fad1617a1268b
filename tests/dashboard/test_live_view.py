"""The dispatcher's live view (dispatcher/dashboard/live.py) and the dashboard's reading of it (dispatcher/dashboard/view.py,
app.py) against the real Valkey and PostgreSQL: the shims' keys are written here as the shim writes them
(contract.keys; shim/caps.py's holds), the dispatcher's by LiveRun itself."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from psycopg.types.json import Jsonb
from rich.console import Console

from contract import keys
from dispatcher.dashboard.app import start
from dispatcher.dashboard.live import LiveRun, start_live
from dispatcher.dashboard.view import ValkeyLiveSource
from dispatcher.driver.progress import Progress, eta_s
from dispatcher.plan import make_plan
from dispatcher.spec import load_spec
from tests.e2e.test_local_run import without_gateway

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Task:
    exit_code: int | None = None


@dataclass
class Loop:
    target: int
    running: dict
    paused: bool = False
    hold_calls: bool = False
    ceiling: int = 2
    outage_s: float | None = None


def plan_for(tmp: Path, run: str):
    text = without_gateway((ROOT / "examples" / "local.toml").read_text()).replace('name = "local-demo"',
                                                                                  f'name = "{run}"')
    text = text.replace('"synthetic/', f'"{ROOT}/examples/synthetic/').replace("run_usd = 2.0", "run_usd = 0.5")
    text = text.replace('max_tokens = 1024', f'max_tokens = 1024\npool = "pool-{run}"')  # a pool of its own
    spec = tmp / "spec.toml"
    spec.write_text(text)
    return make_plan(load_spec(spec), str(spec))


def add_calls(pg, run: str, pool: str, n: int, cost: str, wait_ms: float, latency_ms: float) -> None:
    for i in range(n):
        pg.execute(
            "INSERT INTO calls (call_id, run, instance_id, attempt, seq, pool, provider, model, route, stream,"
            " started_at, input_tokens, cached_tokens, cache_write_tokens, output_tokens, cost_usd, latency_ms,"
            " pacer_wait_ms, retries, http_status, outcome, usage_estimated) VALUES (%s,%s,'i',1,%s,%s,'openai','m',"
            "'openai',false,%s,10,0,0,5,%s,%s,%s,0,200,'ok',false)",
            (uuid.uuid4(), run, i, pool, datetime.now(UTC), Decimal(cost), latency_ms, wait_ms))
    pg.commit()


def view(valkey_url: str, run: str):
    async def go():
        r = aioredis.Redis.from_url(valkey_url)
        try:
            return await ValkeyLiveSource(r).run(run), await ValkeyLiveSource(r).runs()
        finally:
            await r.aclose()
    return asyncio.run(go())


def test_a_run_live_then_finished(tmp_path, pg, valkey, valkey_url, unique):
    plan = plan_for(tmp_path, unique)
    pool = plan.spec.pool
    assert pool == f"pool-{unique}"
    refs = plan.refs
    running = {refs[0]: Task(), refs[1]: Task(), refs[2]: Task(exit_code=0)}  # the third exited, not yet landed
    live = LiveRun(valkey, plan, Loop(target=3, running=running), every_s=0, pool_every_s=0, ledger_every_s=0)
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'local', 5)",
               (unique, Jsonb({})))
    add_calls(pg, unique, pool, 6, "0.000100001", wait_ms=25, latency_ms=100)
    # What the shims keep: the run budget (micro-dollars), a hold per call in flight, progress per attempt.
    budget = keys.run_budget(unique)
    valkey.hset(budget, mapping={"spent": 600006, "held": 1500})
    now_ms = int(time.time() * 1000)
    valkey.zadd(budget + ":exp", {"call-a": now_ms + 60_000, "call-b": now_ms + 60_000, "stale": now_ms - 1})
    valkey.hset(keys.progress(refs[0]), mapping={"phase": "harness", "calls": 4, "turns": 4, "tokens": 900,
                                                 "cost_usd": "0.000400004", "heartbeat_at": f"{time.time():.3f}"})
    valkey.hset(keys.progress(refs[1]), mapping={"phase": "harness", "calls": 2, "cost_usd": "0.000200002"})
    valkey.hset(keys.pool_limits(pool), mapping={"rpm": 500, "itpm": 200000})
    valkey.set(keys.pool_state(pool), json.dumps({"source": "adapted", "decreases": 2, "increases": 1}))
    valkey.hset(keys.pool_discovered(pool), keys.THROTTLED_FIELD, 7)
    try:
        live.update({"RESOLVED": 1, "PATCH_READY": 1}, running)
        v, runs = view(valkey_url, unique)
        assert v.state == "running" and v.planned == 5 and v.landed == 2 and v.final == 1
        assert v.statuses == {"RESOLVED": 1, "PATCH_READY": 1}
        assert (v.running, v.target, v.concurrency) == (2, 3, 2)
        assert (v.spent_usd, v.held_usd, v.run_cap_usd) == ("0.600006", "0.0015", "0.5")
        assert v.spent_share == pytest.approx(0.600006 / 0.5) and v.spend_source == "run budget (live)"
        assert v.calls_in_flight == 2  # the live holds; the expired one is not a call in flight
        assert v.calls == 6  # the ledger so far
        assert [(a.instance_id, a.calls, a.cost_usd) for a in v.attempts] == [
            (refs[0].instance_id, 4, "0.000400004"), (refs[1].instance_id, 2, "0.000200002")]
        p = v.pool_view
        assert p.limits == {"rpm": 500, "itpm": 200000} and (p.source, p.decreases, p.increases) == ("adapted", 2, 1)
        assert p.throttled_total == 7 and p.admitted_per_min == 6.0 and p.wait_share == pytest.approx(0.25)
        assert any(r.run == unique and r.state == "running" for r in runs)
        assert v.outage_s is None

        # The pool's outage breaker open: the view says for how long.
        live.loop.outage_s = 42.0
        live.update({"RESOLVED": 1, "PATCH_READY": 1}, running)
        assert view(valkey_url, unique)[0].outage_s == 42.0
        live.loop.outage_s = None
        assert not v.paused and not v.calls_held

        # `pause --hold-calls`: the view says the shims hold calls (the page: "paused (calls held)").
        live.loop.paused = live.loop.hold_calls = True
        live.update({"RESOLVED": 1, "PATCH_READY": 1}, running)
        held = view(valkey_url, unique)[0]
        assert held.paused and held.calls_held
        live.loop.paused = live.loop.hold_calls = False

        # Shims that publish their calls in flight are counted exactly, not from the holds.
        valkey.hset(keys.progress(refs[0]), "in_flight", 3)
        valkey.hset(keys.progress(refs[1]), "in_flight", 0)
        assert view(valkey_url, unique)[0].calls_in_flight == 3

        # A graded patch: PATCH_READY goes to 0 (not left behind), and a task that ended leaves the list.
        running[refs[0]].exit_code = 0
        live.update({"RESOLVED": 2}, running)
        v = view(valkey_url, unique)[0]
        assert v.statuses == {"RESOLVED": 2, "PATCH_READY": 0} and v.running == 1
        assert [a.instance_id for a in v.attempts] == [refs[1].instance_id]

        # A driver that stops publishing shows as stale.
        valkey.hset(keys.run_live(unique), "updated_at", f"{time.time() - 120:.3f}")
        assert view(valkey_url, unique)[0].state == "stale"

        # The end: the figures from the rows and the ledger, kept after the run's own keys are gone.
        pg.execute("INSERT INTO attempts (run, instance_id, attempt, harness, pool, model, outcome, status) VALUES"
                   " (%s, 'i', 1, 'h', %s, 'm', 'submitted', 'RESOLVED')", (unique, pool))
        pg.commit()
        final = live.finish()
        valkey.delete(budget, budget + ":exp", keys.progress(refs[1]))
        v = view(valkey_url, unique)[0]
        assert v.state == "finished" and v.spend_source == "ledger (final)"
        assert v.spent_usd == final["spent_usd"] == "0.000600006" and v.calls == 6
        assert v.statuses == {"RESOLVED": 1, "PATCH_READY": 0} and v.running == 0 and v.attempts == []
        assert valkey.ttl(keys.run_live(unique)) > 24 * 3600
    finally:
        valkey.delete(keys.run_live(unique), keys.run_live_running(unique), budget, budget + ":exp",
                      keys.pool_limits(pool), keys.pool_state(pool), keys.pool_discovered(pool),
                      keys.pool_live(pool), *(keys.progress(r) for r in refs))
        valkey.zrem(keys.live_runs(), unique)


def test_the_app_serves_json_events_and_the_page(valkey, valkey_url, unique):
    valkey.hset(keys.run_live(unique), mapping={"run": unique, "state": "running", "planned": 3, "status:RESOLVED": 1,
                                                "updated_at": f"{time.time():.3f}"})
    valkey.zadd(keys.live_runs(), {unique: time.time()})

    async def go():
        runner, url = await start(valkey_url, "127.0.0.1", 0, interval_s=0.2)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url) as r:
                    page = await r.text()
                    assert r.status == 200 and "EventSource" in page and 'id="spent"' in page
                async with s.get(url + f"api/runs/{unique}") as r:
                    assert r.status == 200 and (await r.json())["statuses"] == {"RESOLVED": 1}
                async with s.get(url + "api/runs/no-such-run") as r:
                    assert r.status == 404 and "no live view" in (await r.json())["error"]
                async with s.get(url + "api/runs") as r:
                    assert unique in [x["run"] for x in await r.json()]
                async with s.get(url + f"events/{unique}") as r:
                    assert r.headers["Content-Type"] == "text/event-stream"
                    first = await _event(r)
                    assert first[0] == "view" and json.loads(first[1])["final"] == 1
                    valkey.hset(keys.run_live(unique), "status:RESOLVED", 2)  # a change is pushed
                    second = await _event(r)
                    assert json.loads(second[1])["final"] == 2
        finally:
            await runner.cleanup()

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        valkey.delete(keys.run_live(unique))
        valkey.zrem(keys.live_runs(), unique)


async def _event(resp) -> tuple[str, str]:
    event, data = "", ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            return event, data
    raise AssertionError("the stream ended")


def test_terminal_progress_shows_statuses_spend_against_the_cap_and_an_eta(tmp_path, valkey, unique):
    assert eta_s(done=2, total=10, elapsed_s=30.0) == pytest.approx(120.0)  # 8 left at 15 s each
    assert eta_s(done=5, total=10, elapsed_s=30.0, done_at_start=4) == pytest.approx(150.0)  # a resumed run
    assert eta_s(done=3, total=10, elapsed_s=30.0, done_at_start=3) is None
    plan = plan_for(tmp_path, unique)
    live = LiveRun(valkey, plan, Loop(target=1, running={}))
    valkey.hset(keys.run_budget(unique), "spent", 460_000)
    try:
        console = Console(record=True, width=120, force_terminal=False)
        progress = Progress(console, unique, 5, live=live)
        line = progress.line({"RESOLVED": 2, "PATCH_READY": 1}, 1, live.spend()[0], 90.0)
        assert "3/5 landed (patch_ready 1, resolved 2)" in line and "$0.460000 of $0.5" in line
        assert "ETA 1m30s" in line
        console.print(progress.panel({"RESOLVED": 2, "UNRESOLVED": 1}, 2, live.spend()[0], 30.0))
        text = console.export_text()
        assert "3/5 final" in text and "resolved 2" in text and "unresolved 1" in text
        assert "spent $0.460000 of $0.5 cap (92.0%)" in text and "2 task(s) running" in text
    finally:
        valkey.delete(keys.run_budget(unique))


def test_a_run_with_backend_dashboard_serves_it_from_the_driver(tmp_path, valkey, valkey_url, unique, monkeypatch):
    from tests.conftest import free_port

    port = free_port()
    monkeypatch.setenv("EVALPLANE_DASHBOARD_PORT", str(port))
    plan = plan_for(tmp_path, unique)
    plan.spec.backend.dashboard = True
    console = Console(record=True, width=200)
    live = start_live(valkey, plan, Loop(target=1, running={}), valkey_url, console)
    try:
        assert live.dashboard_url == f"http://127.0.0.1:{port}/"
        assert f"dashboard: http://127.0.0.1:{port}/?run={unique}" in console.export_text()
        live.update({"RESOLVED": 1}, {})

        async def get():
            async with aiohttp.ClientSession() as s, s.get(live.dashboard_url + f"api/runs/{unique}") as r:
                return r.status, await r.json()

        status, body = asyncio.run(get())
        assert status == 200 and body["statuses"] == {"RESOLVED": 1} and body["state"] == "running"
        # A second run on the same machine finds the port taken: it says so and runs on without one.
        again = start_live(valkey, plan, Loop(target=1, running={}), valkey_url, console)
        assert again.dashboard_url is None and f"port {port} is taken" in console.export_text()
    finally:
        valkey.delete(keys.run_live(unique), keys.run_live_running(unique), keys.pool_live(plan.spec.pool))
        valkey.zrem(keys.live_runs(), unique)
