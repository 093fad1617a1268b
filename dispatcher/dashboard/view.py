"""What the dashboard shows, read from Valkey only: the dispatcher's live view of each run and pool, the shims'
progress keys and run budgets, the PoolPacer's limits and the shims' 429 count.

Liveness never touches PostgreSQL: a run's final figures (spend and calls from the ledger) are what the
dispatcher wrote to its live view when the run ended.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal
from typing import Protocol

import redis.asyncio as aioredis
from pydantic import BaseModel

from contract import keys
from contract.models import AttemptRef

STALE_AFTER_S = 30.0  # a running run whose driver has not published for this long is shown as stale
MAX_ATTEMPTS_SHOWN = 200  # running attempts listed, most expensive first (all of them are summed)
PROGRESS_FIELDS = ("phase", "calls", "turns", "tokens", "cost_usd", "stopped", "heartbeat_at", "in_flight")


class AttemptView(BaseModel):
    instance_id: str
    attempt: int
    phase: str = ""
    calls: int = 0
    turns: int = 0
    tokens: int = 0
    cost_usd: str = "0"
    stopped: str = ""
    heartbeat_age_s: float | None = None


class PoolView(BaseModel):
    pool: str
    limits: dict[str, int] = {}  # what the shims pace against now (the PoolPacer's)
    source: str = ""  # spec | discovered | adapted
    decreases: int = 0
    increases: int = 0
    throttled_total: int = 0  # provider 429s the shims absorbed (retried), pool-wide
    admitted_per_min: float | None = None  # from the pool's recent ledger, as the driver measured it
    wait_share: float | None = None  # pacer wait / call latency over the same window
    window_s: float | None = None
    measured_age_s: float | None = None


class RunView(BaseModel):
    run: str
    state: str  # running | finished | cancelled | stale (no driver has published for STALE_AFTER_S)
    model: str = ""
    harness: str = ""
    backend: str = ""
    pool: str = ""
    planned: int = 0
    landed: int = 0
    final: int = 0  # landed with a final status (PATCH_READY waits for the grader)
    statuses: dict[str, int] = {}
    running: int = 0  # tasks the driver has
    target: int | None = None  # the planner's target concurrency
    concurrency: int | None = None  # the ceiling the planner works under (the spec's, or `resize`'s)
    paused: bool = False  # `pause`: the driver launches nothing new
    calls_held: bool = False  # `pause --hold-calls`: the shims hold new model calls too
    outage_s: float | None = None  # the pool's outage breaker open this long: calls held, nothing launched
    run_cap_usd: str = ""
    spent_usd: str = "0"  # live: the run budget the shims settle; once ended: the ledger's sum
    held_usd: str = "0"  # held for calls in flight
    spend_source: str = ""  # "run budget (live)" | "ledger (final)"
    spent_share: float | None = None
    calls: int | None = None  # the ledger's calls: landed so far while running, all of them once ended
    calls_in_flight: int = 0
    attempts: list[AttemptView] = []
    pool_view: PoolView | None = None
    updated_at: float | None = None
    age_s: float | None = None


class RunSummary(BaseModel):
    run: str
    state: str
    planned: int
    final: int
    updated_at: float


class LiveSource(Protocol):
    async def runs(self) -> list[RunSummary]: ...
    async def run(self, run: str) -> RunView | None: ...


def _s(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def _int(v: bytes | str | None) -> int:
    try:
        return int(float(_s(v) or 0))
    except ValueError:
        return 0


def _float(v: bytes | str | None) -> float | None:
    try:
        return float(_s(v)) if _s(v) else None
    except ValueError:
        return None


def _usd(micro: bytes | str | None) -> Decimal:
    return Decimal(_int(micro)) / Decimal(1_000_000)


def _state(fields: dict[str, str], now: float) -> str:
    state = fields.get("state", "running")
    updated = _float(fields.get("updated_at"))
    if state == "running" and updated is not None and now - updated > STALE_AFTER_S:
        return "stale"
    return state


class ValkeyLiveSource:
    def __init__(self, r: aioredis.Redis):
        self.r = r

    async def runs(self) -> list[RunSummary]:
        names = [_s(n) for n in await self.r.zrevrange(keys.live_runs(), 0, 99)]
        async with self.r.pipeline(transaction=False) as p:
            for n in names:
                p.hgetall(keys.run_live(n))
            hashes = await p.execute()
        now, out = time.time(), []
        for n, h in zip(names, hashes):
            f = {_s(k): _s(v) for k, v in h.items()}
            if not f:
                continue  # expired
            final = sum(_int(v) for k, v in f.items() if k.startswith("status:") and k != "status:PATCH_READY")
            out.append(RunSummary(run=n, state=_state(f, now), planned=_int(f.get("planned")), final=final,
                                  updated_at=_float(f.get("updated_at")) or 0.0))
        return out

    async def run(self, run: str) -> RunView | None:
        raw = await self.r.hgetall(keys.run_live(run))
        if not raw:
            return None
        f = {_s(k): _s(v) for k, v in raw.items()}
        now = time.time()
        state = _state(f, now)
        statuses = {k.removeprefix("status:"): _int(v) for k, v in f.items() if k.startswith("status:")}
        view = RunView(
            run=run, state=state, model=f.get("model", ""), harness=f.get("harness", ""),
            backend=f.get("backend", ""), pool=f.get("pool", ""), planned=_int(f.get("planned")),
            landed=_int(f.get("landed")), statuses=statuses,
            final=sum(n for s, n in statuses.items() if s != "PATCH_READY"), running=_int(f.get("running")),
            target=_int(f.get("target")) if f.get("target") else None,
            concurrency=_int(f.get("concurrency")) if f.get("concurrency") else None,
            paused=f.get("paused") == "1", calls_held=f.get("calls_held") == "1",
            outage_s=_float(f.get("outage_s")) if f.get("outage_s") else None,
            run_cap_usd=f.get("run_cap_usd", ""), updated_at=_float(f.get("updated_at")),
        )
        view.age_s = None if view.updated_at is None else round(now - view.updated_at, 1)
        if state in ("finished", "cancelled"):
            view.spent_usd, view.spend_source = f.get("spent_usd", "0"), "ledger (final)"
            view.calls = _int(f.get("calls"))
        else:
            await self._live_spend(view)
            view.calls = _int(f.get("ledger_calls")) if "ledger_calls" in f else None
        if view.run_cap_usd and Decimal(view.run_cap_usd) > 0:
            view.spent_share = float(Decimal(view.spent_usd) / Decimal(view.run_cap_usd))
        if view.pool:
            view.pool_view = await self.pool(view.pool)
        return view

    async def _live_spend(self, view: RunView) -> None:
        """The run budget as the shims keep it, each attempt's progress, and the calls holding budget now."""
        budget = keys.run_budget(view.run)
        running = sorted(_s(m) for m in await self.r.smembers(keys.run_live_running(view.run)))
        refs = []
        for m in running:
            iid, _, n = m.rpartition("/")
            if iid and n.isdigit():
                refs.append(AttemptRef(run=view.run, instance_id=iid, attempt=int(n)))
        async with self.r.pipeline(transaction=False) as p:
            p.hmget(budget, ["spent", "held"])
            p.zcount(budget + ":exp", int(time.time() * 1000), "+inf")  # a hold per call in flight (shim/caps.py)
            for ref in refs:
                p.hmget(keys.progress(ref), list(PROGRESS_FIELDS))
            spent_held, holds, *progress = await p.execute()
        view.spent_usd, view.held_usd = str(_usd(spent_held[0])), str(_usd(spent_held[1]))
        view.spend_source = "run budget (live)"
        now, attempts, in_flight, counted = time.time(), [], 0, False
        for ref, vals in zip(refs, progress):
            pf = dict(zip(PROGRESS_FIELDS, (_s(v) for v in vals)))
            in_flight += _int(pf["in_flight"])
            counted |= pf["in_flight"] != ""
            beat = _float(pf["heartbeat_at"])
            attempts.append(AttemptView(
                instance_id=ref.instance_id, attempt=ref.attempt, phase=pf["phase"], calls=_int(pf["calls"]),
                turns=_int(pf["turns"]), tokens=_int(pf["tokens"]), cost_usd=pf["cost_usd"] or "0",
                stopped=pf["stopped"], heartbeat_age_s=None if beat is None else round(now - beat, 1)))
        # Shims that publish in_flight in their progress key are counted exactly; else the budget's live holds.
        view.calls_in_flight = in_flight if counted else int(holds)
        attempts.sort(key=lambda a: (-Decimal(a.cost_usd or "0"), a.instance_id, a.attempt))
        view.attempts = attempts[:MAX_ATTEMPTS_SHOWN]

    async def pool(self, pool: str) -> PoolView:
        async with self.r.pipeline(transaction=False) as p:
            p.hgetall(keys.pool_limits(pool))
            p.get(keys.pool_state(pool))
            p.hget(keys.pool_discovered(pool), keys.THROTTLED_FIELD)
            p.hgetall(keys.pool_live(pool))
            limits, state, throttled, live = await p.execute()
        view = PoolView(pool=pool, limits={_s(k): _int(v) for k, v in limits.items()}, throttled_total=_int(throttled))
        if state:
            st = json.loads(state)
            view.source, view.decreases, view.increases = st.get("source", ""), st.get("decreases", 0), \
                st.get("increases", 0)
        lv = {_s(k): _s(v) for k, v in live.items()}
        if lv:
            view.admitted_per_min, view.wait_share = _float(lv.get("admitted_per_min")), _float(lv.get("wait_share"))
            view.window_s = _float(lv.get("window_s"))
            at = _float(lv.get("updated_at"))
            view.measured_age_s = None if at is None else round(time.time() - at, 1)
        return view
