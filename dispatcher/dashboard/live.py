"""The driver's side of the live dashboard: what only the dispatcher knows about a run, written to Valkey.

The shims write each attempt's progress key and the run's budget (spent, held, a hold per call in flight). The
driver adds, about once a second, the run's attempts per status (from its own land check), the attempts it has a
task for, the planner's target and the caps; every few seconds, each pool's admitted calls per minute and
pacer-wait share from the pool's recent ledger; and at the run's end the final figures from the ledger, so the
dashboard still shows how the run ended once the run's own keys are gone. The dashboard reads only these keys.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any, Protocol

import psycopg
import redis

from contract import db, keys
from contract.models import AttemptRef
from dispatcher.plan import Plan

log = logging.getLogger("evalplane.live")

POOL_WINDOW_S = 60.0


class DriverView(Protocol):
    """What LiveRun reads from the driver loop (dispatcher.driver.loop.DriverLoop)."""

    target: int
    running: Mapping[AttemptRef, Any]  # values have .exit_code (None while the task runs)
    paused: bool  # the run's control state as of the last pass
    hold_calls: bool  # ... and whether its shims hold new model calls (`pause --hold-calls`)
    ceiling: int  # the concurrency the planner works under (the spec's, or `resize`'s)


def micro_to_usd(value: str | bytes | None) -> Decimal:
    return Decimal(int(value or 0)) / Decimal(1_000_000)


def pool_pacing(conn: psycopg.Connection, pool: str, window_s: float = POOL_WINDOW_S) -> dict[str, str]:
    """The pool's calls that started in the last `window_s` seconds, from the ledger (calls_pool_recent index)."""
    n, wait, latency = conn.execute(
        "SELECT count(*), coalesce(sum(pacer_wait_ms), 0), coalesce(sum(latency_ms), 0) FROM calls"
        " WHERE pool = %s AND started_at > now() - make_interval(secs => %s)", (pool, window_s)).fetchone()
    conn.commit()
    return {"admitted_per_min": f"{n * 60.0 / window_s:.1f}", "calls": str(n),
            "wait_share": f"{(wait / latency if latency else 0.0):.4f}", "window_s": f"{window_s:g}",
            "updated_at": f"{time.time():.3f}"}


def ledger_totals(conn: psycopg.Connection, run: str) -> dict[str, str]:
    """The calls landed so far and their cost (the ledger lags the shims by a batch interval and the writer)."""
    calls, spent = conn.execute("SELECT count(*), coalesce(sum(cost_usd), 0) FROM calls WHERE run = %s",
                                (run,)).fetchone()
    conn.commit()
    return {"ledger_calls": str(calls), "ledger_spent_usd": str(spent)}


def run_totals(conn: psycopg.Connection, run: str) -> dict[str, str]:
    """The run's final figures: attempts per status from the rows, calls and spend from the ledger (to the
    micro-dollar: numeric in PostgreSQL, a decimal string here)."""
    counts = dict(conn.execute("SELECT status, count(*) FROM attempts WHERE run = %s GROUP BY status",
                               (run,)).fetchall())
    row = conn.execute("SELECT status FROM runs WHERE run = %s", (run,)).fetchone()
    ledger = ledger_totals(conn, run)
    out = {f"status:{s}": str(n) for s, n in counts.items()}
    return out | ledger | {"landed": str(sum(counts.values())), "calls": ledger["ledger_calls"],
                           "spent_usd": ledger["ledger_spent_usd"],
                           "state": "cancelled" if row and row[0] == "cancelled" else "finished"}


class LiveRun:
    """Publishes a run's live view; `update` is called on every driver pass and writes at most every `every_s`."""

    def __init__(self, valkey: redis.Redis, plan: Plan, loop: DriverView,
                 connect: Callable[[], psycopg.Connection] = db.connect, every_s: float = 1.0,
                 pool_every_s: float = 5.0, ledger_every_s: float = 15.0):
        self.valkey, self.plan, self.loop, self.connect = valkey, plan, loop, connect
        spec = plan.spec
        self.run, self.pool = spec.run.name, spec.pool
        self.every_s, self.pool_every_s, self.ledger_every_s = every_s, pool_every_s, ledger_every_s
        self._conn: psycopg.Connection | None = None
        self._last = self._last_pool = self._last_ledger = -1e9
        self._started = time.time()
        self._running_members: set[str] = set()
        self._statuses: set[str] = set()  # every status published: one whose count went back to 0 is written as 0
        self._fresh = True  # the first write replaces what an earlier driver of the run published
        self._static = {
            "run": self.run, "pool": self.pool, "planned": str(len(plan.refs)),
            "run_cap_usd": str(spec.budget.run_usd), "attempt_cap_usd": str(spec.budget.attempt_usd or ""),
            "model": spec.model.model, "harness": spec.harness.name, "backend": spec.backend.kind,
            "concurrency": str(spec.backend.concurrency), "started_at": f"{self._started:.3f}",
        }
        self.dashboard_url: str | None = None

    # ------------------------------------------------------------ publishing

    def update(self, counts: Mapping[str, int], running: Mapping[AttemptRef, Any]) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        try:
            self._publish(counts, running, now)
        except (redis.RedisError, psycopg.Error) as e:  # the live view is best effort; the rows are the record
            log.warning("live view not updated: %s", e)

    def _publish(self, counts: Mapping[str, int], running: Mapping[AttemptRef, Any], now: float) -> None:
        alive = {f"{r.instance_id}/{r.attempt}" for r, t in list(running.items()) if t.exit_code is None}
        self._statuses |= set(counts)
        fields = self._static | {f"status:{s}": str(counts.get(s, 0)) for s in self._statuses}
        fields |= {"state": "running", "landed": str(sum(counts.values())), "running": str(len(alive)),
                   "target": str(self.loop.target), "updated_at": f"{time.time():.3f}",
                   "paused": "1" if self.loop.paused else "0", "calls_held": "1" if self.loop.hold_calls else "0",
                   "concurrency": str(self.loop.ceiling),
                   "outage_s": "" if self.loop.outage_s is None else f"{self.loop.outage_s:.1f}",
                   "planned": str(len(self.plan.refs))}
        pacing = None
        if now - self._last_pool >= self.pool_every_s:  # the ledger's figures, every few seconds
            self._last_pool = now
            pacing = pool_pacing(self._db(), self.pool)
            if now - self._last_ledger >= self.ledger_every_s:  # a sum over the run's whole ledger: less often
                self._last_ledger = now
                fields |= ledger_totals(self._db(), self.run)
        with self.valkey.pipeline(transaction=True) as p:
            if self._fresh:
                p.delete(keys.run_live(self.run), keys.run_live_running(self.run))
                p.zremrangebyscore(keys.live_runs(), "-inf", time.time() - keys.LIVE_TTL_S)  # runs whose view expired
                self._running_members = set()
            p.hset(keys.run_live(self.run), mapping=fields)
            p.expire(keys.run_live(self.run), keys.LIVE_TTL_S)
            gone = self._running_members - alive
            if gone:
                p.srem(keys.run_live_running(self.run), *gone)
            if alive - self._running_members:
                p.sadd(keys.run_live_running(self.run), *(alive - self._running_members))
            p.expire(keys.run_live_running(self.run), keys.LIVE_TTL_S)
            p.zadd(keys.live_runs(), {self.run: time.time()})
            if pacing:
                p.hset(keys.pool_live(self.pool), mapping=pacing)
                p.expire(keys.pool_live(self.pool), keys.LIVE_TTL_S)
            p.execute()
        self._running_members, self._fresh = alive, False

    def _db(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = self.connect()
        return self._conn

    def spend(self) -> tuple[Decimal, Decimal] | None:
        """(spent, held) on the run's budget as the shims keep it, in USD; None if Valkey does not answer."""
        try:
            spent, held = self.valkey.hmget(keys.run_budget(self.run), ["spent", "held"])
        except redis.RedisError:
            return None
        return micro_to_usd(spent), micro_to_usd(held)

    def finish(self) -> dict[str, str] | None:
        """The run's final view from its rows and ledger (the run's own Valkey keys are about to go); None if the
        database did not answer (the run's end does not wait on its live view)."""
        try:
            final = run_totals(self._db(), self.run)
        except psycopg.Error as e:
            log.warning("live view not finished: %s", e)
            return None
        fields = self._static | {f"status:{s}": "0" for s in self._statuses} | final | {
            "running": "0", "updated_at": f"{time.time():.3f}", "finished_at": f"{time.time():.3f}"}
        try:
            with self.valkey.pipeline(transaction=True) as p:
                p.delete(keys.run_live(self.run), keys.run_live_running(self.run))
                p.hset(keys.run_live(self.run), mapping=fields)
                p.expire(keys.run_live(self.run), keys.LIVE_TTL_S)
                p.zadd(keys.live_runs(), {self.run: time.time()})
                p.hset(keys.pool_live(self.pool), mapping=pool_pacing(self._db(), self.pool))
                p.execute()
        except (redis.RedisError, psycopg.Error) as e:
            log.warning("live view not finished: %s", e)
        if self._conn is not None:
            self._conn.close()
        return fields

    # ------------------------------------------------------------ the dashboard with the run

    def serve_dashboard(self, valkey_url: str, host: str = "127.0.0.1", port: int = 8270,
                        token: str | None = None) -> str | None:
        """backend.dashboard = true: serve the dashboard from this process while the run goes (a daemon thread;
        its controls take `token`). Returns its URL, or None when the port is taken (another dashboard serves it)."""
        from dispatcher.dashboard.app import serve_in_thread

        try:
            self.dashboard_url = serve_in_thread(valkey_url, host, port, token)
        except OSError as e:
            log.warning("dashboard not started on %s:%d: %s", host, port, e)
            return None
        return self.dashboard_url


def start_live(valkey: redis.Redis, plan: Plan, loop: DriverView, valkey_url: str, console=None) -> LiveRun:
    """The run's live view (dispatcher.driver.loop calls this once its driver loop exists); with backend.dashboard = true,
    the dashboard too, served from this process while the run goes."""
    live = LiveRun(valkey, plan, loop)
    if plan.spec.backend.dashboard:
        from dispatcher.dashboard.app import DEFAULT_PORT, load_token

        port = int(os.environ.get("EVALPLANE_DASHBOARD_PORT", DEFAULT_PORT))
        token = load_token(None)
        url = live.serve_dashboard(valkey_url, port=port, token=token)
        if console is not None:
            console.print(f"dashboard: {url}?run={plan.spec.run.name} (control token: {token})" if url else
                          f"dashboard: port {port} is taken (is `python -m dispatcher dashboard` already serving?)")
    return live
