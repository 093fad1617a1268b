"""Fleet sizing from the pacer's ledger: launch as many tasks as the pool's limits can feed, and no more.

Idle tasks cost money (a Fargate task waiting on the pacer is billed all the same), so the target is
what the pool can feed: calls per minute the limits allow (requests, input and output tokens, at the
pool's observed tokens per call) over calls per minute one task makes when it does not wait (its
turn: the call's latency and the agent's own work between calls, from the recent ledger), with a
little headroom so that the limits stay busy while tasks start and end; bounded by the spec.
Before the ledger shows a turn (or while the limits are unknown) the fleet grows step by step
while the shims' pacer wait stays low, and holds when tasks would only wait.
"""

from __future__ import annotations

import math

import psycopg
from pydantic import BaseModel

from contract.compute_prices import Capacity, ComputePrices
from contract.models import TaskResources
from contract.pricing import Price


class PoolObservation(BaseModel):
    """Per-attempt and per-call averages of a pool, from the ledger (or the prior before any history)."""

    basis: str  # "ledger (N attempts)" or "prior"
    calls_per_attempt: float
    input_per_call: float  # uncached input + cache writes: what counts toward input limits
    cached_per_call: float
    output_per_call: float
    attempt_minutes: float
    pacer_wait_share: float = 0.0  # pacer wait / the time between an attempt's calls, recent calls
    grading_minutes: float = 5.0  # one grading's wall time (the prior: a SWE-bench eval script in its container)
    graded_share: float = 1.0  # of attempts, those with a patch to grade (the prior: every one)
    turn_s: float | None = None  # between an attempt's calls, its pacer wait taken out (None: not seen yet)
    calling: int | None = None  # attempts that made calls lately (None: not read from the ledger)
    calling_share: float | None = None  # of an ended attempt's time, the part from its first call to its last
    runs: int = 1  # runs that made calls on the pool lately: each sizes its fleet for its share of the limits


# Before any history: a modest SWE-bench agent attempt (tens of turns, growing context, mostly cached).
PRIOR = PoolObservation(basis="prior", calls_per_attempt=40, input_per_call=3000, cached_per_call=20000,
                        output_per_call=400, attempt_minutes=8)


def recent_turns(conn: psycopg.Connection, pool: str, window_s: float) -> tuple[int, float, float, int, int]:
    """Over the pool's calls that started within the last window_s: (gaps seen, mean time from one call of an
    attempt to its next without the first's pacer wait, pacer wait's share of that time with the wait, attempts
    that made those calls, runs they belong to)."""
    row = conn.execute(
        """SELECT count(gap), avg(gap - wait), sum(wait) / nullif(sum(gap), 0),
                  count(DISTINCT (run, instance_id, attempt)), count(DISTINCT run) FROM (
             SELECT run, instance_id, attempt, extract(epoch FROM started_at - lag(started_at) OVER w) AS gap,
                    lag(pacer_wait_ms) OVER w / 1000 AS wait
             FROM calls WHERE pool = %s AND started_at > now() - make_interval(secs => %s)
             WINDOW w AS (PARTITION BY run, instance_id, attempt ORDER BY seq)) g""", (pool, window_s)).fetchone()
    conn.commit()
    return int(row[0] or 0), float(row[1] or 0.0), float(row[2] or 0.0), int(row[3] or 0), int(row[4] or 0)


def observe(conn: psycopg.Connection, pool: str, recent_calls: int = 2000, window_s: float = 60.0,
            min_turns: int = 20, calling_s: float = 20.0, runs: list[str] | None = None) -> PoolObservation:
    """runs: observe these runs' attempts and calls rather than the pool's (a forecast's ledger when the pool has
    none of its own); nothing of theirs is live."""
    where, arg = ("run = ANY(%s)", runs) if runs is not None else ("pool = %s", pool)
    row = conn.execute(
        f"""SELECT count(*), avg(calls), avg(wall_time_s) FROM attempts
           WHERE {where} AND calls > 0 AND wall_time_s > 0""", (arg,)).fetchone()
    calls = conn.execute(
        f"""SELECT avg(input_tokens + cache_write_tokens), avg(cached_tokens), avg(output_tokens),
                  sum(pacer_wait_ms) / nullif(sum(latency_ms), 0)
           FROM (SELECT * FROM calls WHERE {where} AND outcome = 'ok' ORDER BY started_at DESC LIMIT %s) c""",
        (arg, recent_calls)).fetchone()
    conn.commit()
    graded = conn.execute(
        f"""SELECT avg(grading_wall_s) FILTER (WHERE grading_wall_s > 0),
                  count(*) FILTER (WHERE patch_bytes > 0)::float / nullif(count(*), 0)
           FROM attempts WHERE {where}""", (arg,)).fetchone()
    conn.commit()
    grading = {"grading_minutes": float(graded[0]) / 60} if graded[0] else {}
    if graded[1] is not None:
        grading["graded_share"] = float(graded[1])
    n_attempts = row[0] or 0
    share = conn.execute(
        f"""SELECT avg(least(1.0, span / wall)) FROM (
             SELECT a.wall_time_s AS wall, extract(epoch FROM max(c.started_at) - min(c.started_at)) AS span
             FROM attempts a JOIN calls c USING (run, instance_id, attempt)
             WHERE a.{where} AND a.wall_time_s > 0 AND a.calls > 1
             GROUP BY a.run, a.instance_id, a.attempt, a.wall_time_s ORDER BY max(a.landed_at) DESC LIMIT 200) x""",
        (arg,)).fetchone()[0]
    conn.commit()
    gaps, turn_s, wait_share, _, n_runs = recent_turns(conn, pool, window_s) if runs is None else (0, 0.0, 0.0, 0, 0)
    if calls[0] is None:
        return PRIOR.model_copy(update={"calling": 0, **grading})
    # the turns' wait share where turns were seen (of task time), else the calls' (of call latency)
    turn = {"turn_s": turn_s, "pacer_wait_share": wait_share} if gaps >= min_turns and turn_s > 0 else {
        "pacer_wait_share": float(calls[3] or 0.0)}
    turn["calling"] = recent_turns(conn, pool, calling_s)[3] if runs is None else 0  # attempts calling now
    turn["calling_share"] = float(share) if share else None
    turn["runs"] = max(1, n_runs)
    if n_attempts == 0:  # calls but no attempt ended yet: the prior's attempt shape, the ledger's calls
        return PRIOR.model_copy(update={"basis": "prior, calls from the ledger", "input_per_call": float(calls[0]),
                                        "cached_per_call": float(calls[1]), "output_per_call": float(calls[2]),
                                        **turn, **grading})
    return PoolObservation(
        basis=f"ledger ({n_attempts} attempts)", calls_per_attempt=float(row[1]),
        input_per_call=float(calls[0]), cached_per_call=float(calls[1]), output_per_call=float(calls[2]),
        attempt_minutes=max(float(row[2]) / 60, 0.05), **turn, **grading,
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
    """low_wait / high_wait: pacer-wait shares of task time under which the fleet may grow, over which it holds.
    headroom: calling tasks beyond what the limits feed, so that the limits stay busy while turns vary.
    max_idle_scale: the most the fleet is scaled up for the tasks not calling (starting, ending).
    The planner keeps one adaptive factor (`scale`): the fleet it targets grows while the pacer hardly makes tasks
    wait (the limits are not saturated, e.g. the pool's bucket holds capacity unused) and shrinks while they wait
    more than high_wait (set under the 10% of task time a run may spend waiting: the share swings around it)."""

    def __init__(self, max_concurrency: int, low_wait: float = 0.05, high_wait: float = 0.08, step: float = 1.5,
                 headroom: float = 1.15, first: int = 4, max_idle_scale: float = 2.0):
        self.max_concurrency, self.low_wait, self.high_wait, self.step = max_concurrency, low_wait, high_wait, step
        self.headroom, self.first, self.max_idle_scale = headroom, first, max_idle_scale
        self.scale, self.max_scale = 1.0, 1.25  # adapted from the pacer wait the turns show

    def target(self, limits: dict[str, int], obs: PoolObservation, remaining: int, current: int) -> int:
        """How many tasks should be running now. Where the limits and turns are known: the calling tasks the limits
        feed, with headroom, scaled up for the part of a task's time it makes no calls (starting, ending: from the
        attempts that ended). Else step by step, a step growing from the tasks that make calls (where the ledger
        says), not from those launched: tasks still starting show nothing about the limits."""
        cpm = calls_per_minute_fed(limits, obs)
        if obs.turn_s and math.isfinite(cpm):
            # pacer wait low: the limits are not saturated (the pool's bucket fills): a little more each time;
            # tasks waiting: a little less (the wait the headroom brings is expected)
            if obs.pacer_wait_share < self.low_wait:
                self.scale = min(self.max_scale, self.scale * 1.1)
            elif obs.pacer_wait_share > self.high_wait:
                self.scale = max(1 / self.headroom, self.scale * 0.9)
            fed = cpm * obs.turn_s / 60 * self.headroom * self.scale / obs.runs  # this run's share of the pool
            if obs.calling_share:
                fed *= min(self.max_idle_scale, 1 / obs.calling_share)
            if obs.pacer_wait_share > self.high_wait:  # tasks wait more than the headroom accounts for
                fed = min(fed, current)
            return max(1, min(remaining, _whole(fed, self.max_concurrency)))
        bound = max(1, min(remaining, _whole(feedable(limits, obs), self.max_concurrency)))
        if obs.pacer_wait_share >= self.high_wait:
            return max(1, min(current, bound))  # tasks would only wait: launch no more
        if obs.pacer_wait_share > self.low_wait:
            return max(1, min(bound, max(current, 1)))
        base = current if obs.calling is None else max(min(current, obs.calling), self.first)
        return max(1, min(bound, max(math.ceil(base * self.step), base + 1)))


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


# A replica is one event loop: past about half its capacity, calls queue behind each other's processing.
GATEWAY_UTILISATION = 0.5


class GatewaySizing(BaseModel):
    calls_per_s: float  # the fleet's calls per second at its predicted size (the limits' rate where they bind)
    replica_calls_per_s: float  # what one replica serves flat out ([gateway] replica_calls_per_s)
    replicas: int


def gateway_replicas(calls_per_s: float, replica_calls_per_s: float, minimum: int = 2) -> int:
    """Replicas that serve `calls_per_s` with none past GATEWAY_UTILISATION of its capacity, and never fewer than
    `minimum` (a replica lost must not stop the run)."""
    return max(minimum, math.ceil(calls_per_s / (replica_calls_per_s * GATEWAY_UTILISATION)))


def size_gateway(p: Prediction, obs: PoolObservation, replica_calls_per_s: float) -> GatewaySizing:
    """The gateway tier for a predicted run: its fleet's calls per second (no more than its limits admit)."""
    rate = p.concurrency * obs.calls_per_attempt / (obs.attempt_minutes * 60)
    if math.isfinite(p.calls_per_minute):
        rate = min(rate, p.calls_per_minute / 60)
    return GatewaySizing(calls_per_s=rate, replica_calls_per_s=replica_calls_per_s,
                         replicas=gateway_replicas(rate, replica_calls_per_s))


class ComputePrediction(BaseModel):
    task_usd: float  # every attempt's task at the spec's resources for the observed attempt time
    grading_usd: float  # the attempts with a patch graded (the observed share of them)
    resources: TaskResources
    spot_share: float = 0.0  # of the tasks, on Spot capacity (backend.spot)
    spot_saving_usd: float = 0.0  # what those cost less than on demand, at the price table's Spot rates

    @property
    def total_usd(self) -> float:
        return self.task_usd + self.grading_usd


def predict_compute(n_attempts: int, obs: PoolObservation, resources: TaskResources,
                    prices: ComputePrices, spot: float = 0.0) -> ComputePrediction:
    """What the attempts' compute will cost: the same price table the report prices recorded figures with; `spot`
    of the tasks at its Spot rates (Fargate Spot's discount), the rest at its on-demand rates."""
    def task_at(capacity: Capacity) -> float:
        return prices.task_usd(resources.cpu, resources.memory_limit_mib, obs.attempt_minutes * 60, capacity) or 0.0

    on_demand, spot_task = task_at("on_demand"), task_at("spot")
    grading = prices.grading_usd(obs.grading_minutes * 60) or 0.0
    return ComputePrediction(task_usd=n_attempts * (on_demand - spot * (on_demand - spot_task)),
                             grading_usd=n_attempts * obs.graded_share * grading, resources=resources,
                             spot_share=spot, spot_saving_usd=n_attempts * spot * (on_demand - spot_task))
