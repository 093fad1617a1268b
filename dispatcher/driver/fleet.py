"""Fleet sizing from the pacer's ledger: launch as many tasks as the pool's limits can feed, and no more.

Idle tasks cost money (a Fargate task waiting on the pacer is billed all the same), so the target is
what the pool can feed: calls per minute the limits allow (requests, input and output tokens, at the
pool's observed tokens per call) over calls per minute one attempt makes, bounded by the spec. While
running it grows only while the shims' pacer wait stays low, and holds when tasks would only wait.
"""

from __future__ import annotations

import math

import psycopg
from pydantic import BaseModel

from contract.pricing import Price


class PoolObservation(BaseModel):
    """Per-attempt and per-call averages of a pool, from the ledger (or the prior before any history)."""

    basis: str  # "ledger (N attempts)" or "prior"
    calls_per_attempt: float
    input_per_call: float  # uncached input + cache writes: what counts toward input limits
    cached_per_call: float
    output_per_call: float
    attempt_minutes: float
    pacer_wait_share: float = 0.0  # pacer wait / call latency, recent calls


# Before any history: a modest SWE-bench agent attempt (tens of turns, growing context, mostly cached).
PRIOR = PoolObservation(basis="prior", calls_per_attempt=40, input_per_call=3000, cached_per_call=20000,
                        output_per_call=400, attempt_minutes=8)


def observe(conn: psycopg.Connection, pool: str, recent_calls: int = 2000) -> PoolObservation:
    row = conn.execute(
        """SELECT count(*), avg(calls), avg(wall_time_s) FROM attempts
           WHERE pool = %s AND calls > 0 AND wall_time_s > 0""", (pool,)).fetchone()
    calls = conn.execute(
        """SELECT avg(input_tokens + cache_write_tokens), avg(cached_tokens), avg(output_tokens),
                  sum(pacer_wait_ms) / nullif(sum(latency_ms), 0)
           FROM (SELECT * FROM calls WHERE pool = %s AND outcome = 'ok' ORDER BY started_at DESC LIMIT %s) c""",
        (pool, recent_calls)).fetchone()
    conn.commit()
    n_attempts = row[0] or 0
    if n_attempts == 0 or calls[0] is None:
        return PRIOR
    return PoolObservation(
        basis=f"ledger ({n_attempts} attempts)", calls_per_attempt=float(row[1]),
        input_per_call=float(calls[0]), cached_per_call=float(calls[1]), output_per_call=float(calls[2]),
        attempt_minutes=max(float(row[2]) / 60, 0.05), pacer_wait_share=float(calls[3] or 0.0),
    )


def calls_per_minute_fed(limits: dict[str, int], obs: PoolObservation) -> float:
    """How many calls a minute the pool's limits admit at the observed call shape (inf if unlimited)."""
    bounds = [math.inf]
    if limits.get("rpm"):
        bounds.append(limits["rpm"])
    if limits.get("itpm") and obs.input_per_call > 0:
        bounds.append(limits["itpm"] / obs.input_per_call)
    if limits.get("otpm") and obs.output_per_call > 0:
        bounds.append(limits["otpm"] / obs.output_per_call)
    return min(bounds)


def feedable(limits: dict[str, int], obs: PoolObservation) -> float:
    """Concurrent attempts the limits can keep busy."""
    per_attempt = obs.calls_per_attempt / obs.attempt_minutes
    return calls_per_minute_fed(limits, obs) / per_attempt if per_attempt > 0 else math.inf


def _whole(x: float, cap: int) -> int:
    """floor(x) for a finite bound, `cap` for an unbounded one; at least 1."""
    return max(1, cap if not math.isfinite(x) else min(cap, math.floor(x)))


class Planner:
    def __init__(self, max_concurrency: int, low_wait: float = 0.05, high_wait: float = 0.20, step: float = 1.5):
        self.max_concurrency, self.low_wait, self.high_wait, self.step = max_concurrency, low_wait, high_wait, step

    def target(self, limits: dict[str, int], obs: PoolObservation, remaining: int, current: int) -> int:
        """How many tasks should be running now."""
        bound = max(1, min(remaining, _whole(feedable(limits, obs), self.max_concurrency)))
        if obs.pacer_wait_share >= self.high_wait:
            return max(1, min(current, bound))  # tasks would only wait: launch no more
        if obs.pacer_wait_share > self.low_wait:
            return max(1, min(bound, max(current, 1)))
        return max(1, min(bound, max(math.ceil(current * self.step), current + 1)))


class Prediction(BaseModel):
    attempts: int
    concurrency: int
    feedable: float
    calls_per_minute: float
    launch_s: float  # starting every task at the launch quota (0 where launches are not paced)
    wall_time_s: float
    cost_usd: float
    capped_by_budget: bool
    basis: str


def launch_seconds(n: int, rate_per_s: float | None, burst: int = 1) -> float:
    """How long starting n tasks takes at a launch quota: a burst at once, then `rate_per_s`."""
    if not rate_per_s or n <= burst:
        return 0.0
    return (n - burst) / rate_per_s


def predict(n_attempts: int, limits: dict[str, int], obs: PoolObservation, price: Price | None,
            max_concurrency: int, run_usd: float, launch_rate_per_s: float | None = None,
            launch_burst: int = 1) -> Prediction:
    """Fleet size, wall time and cost. Wall time is the longest of: waves of attempts at the fleet size (plus the
    time to start the first wave at the launch quota), starting every task at the quota and then running the last
    one, and the calls the pool's limits admit."""
    conc = max(1, min(n_attempts, _whole(feedable(limits, obs), max_concurrency)))
    cpm = calls_per_minute_fed(limits, obs)
    launch_s = launch_seconds(n_attempts, launch_rate_per_s, launch_burst)
    waves = (math.ceil(n_attempts / conc) * obs.attempt_minutes
             + launch_seconds(conc, launch_rate_per_s, launch_burst) / 60)
    launched = launch_s / 60 + obs.attempt_minutes if launch_s else 0
    paced = (n_attempts * obs.calls_per_attempt / cpm) if math.isfinite(cpm) else 0
    per_call = 0.0
    if price:
        per_call = (obs.input_per_call * price.input + obs.cached_per_call * price.cache_read
                    + obs.output_per_call * price.output)
    cost = n_attempts * obs.calls_per_attempt * per_call
    return Prediction(attempts=n_attempts, concurrency=conc, feedable=feedable(limits, obs), calls_per_minute=cpm,
                      launch_s=launch_s, wall_time_s=max(waves, launched, paced) * 60, cost_usd=min(cost, run_usd),
                      capped_by_budget=cost > run_usd, basis=obs.basis)
