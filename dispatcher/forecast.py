"""What a run will take before it starts (fleet, wall time, cost), kept with the run, and against what it took.

The call shape comes from the most relevant ledger: the pool's own (this model with this harness), else this
harness's on the same dataset with other models, else a stated prior. Wall time counts the task images still to
build, the run's start-up (from earlier runs of the same launcher), the attempts at the fleet the limits feed, and
grading at the run's eval workers after them."""

from __future__ import annotations

import math
import statistics
from datetime import datetime

import psycopg
from psycopg.types.json import Jsonb
from pydantic import BaseModel

from dispatcher.driver.fleet import ComputePrediction, GatewaySizing, PoolObservation

# Before any run of a launcher has been seen: from `run` to the first task running (the driver's cluster, the
# run's queues and eval workers, the first task's start).
START_PRIOR_S = 30.0


class Forecast(BaseModel):
    made_at: datetime
    attempts: int  # left to run when it was made
    concurrency: int
    feedable: float | None  # concurrent attempts the limits can keep busy (None: unbounded)
    limits: dict[str, int]
    limits_source: str
    observation: PoolObservation
    start_s: float  # from `run` to the first task running
    start_basis: str
    launch_s: float  # starting every task at the launch quota (0 where launches are not paced)
    attempts_s: float  # the attempts at the fleet size, from the first task's start to the last one's end
    grading_s: float  # what grading adds after the last attempt ends
    images_to_build: int
    image_build_s: float | None  # None: nothing recorded to predict from (counted as 0 in wall_time_s)
    wall_time_s: float
    token_usd: float | None  # None: the model is not in the price table
    capped_by_budget: bool
    compute: ComputePrediction
    gateway: GatewaySizing | None = None  # the gateway tier the run's calls need (None: the spec has no [gateway])

    @property
    def total_usd(self) -> float | None:
        return None if self.token_usd is None else self.token_usd + self.compute.total_usd


class Actual(BaseModel):
    wall_time_s: float | None  # from the forecast (the `run` command's start) to the run's end; None: not ended
    token_usd: float
    compute_usd: float

    @property
    def total_usd(self) -> float:
        return self.token_usd + self.compute_usd


def pool_limits(spec) -> tuple[dict[str, int], str]:
    """The limits the pool runs under, and where they come from: its pacer's (Valkey), else what the shims
    discovered from provider headers on top of the spec's, else the spec's alone."""
    import redis

    from contract import keys
    from dispatcher.cli import stack
    from dispatcher.driver.pacing import PacerPolicy

    limits = {k: v for k, v in {"rpm": spec.model.rpm, "itpm": spec.model.itpm, "otpm": spec.model.otpm}.items() if v}
    # the pool's live limits are what the forecast is of: without Valkey it would forecast another fleet
    r = redis.Redis.from_url(stack.valkey_url(), decode_responses=True)
    stored = r.hgetall(keys.pool_limits(spec.pool))
    discovered = PacerPolicy().discovered(r.hgetall(keys.pool_discovered(spec.pool)))
    if stored:
        return {k: int(v) for k, v in stored.items()}, "the pool's pacer"
    if discovered:
        return limits | discovered, "provider headers the shims recorded"
    return limits, "spec"


def observation(conn: psycopg.Connection, spec) -> PoolObservation:
    """The pool's ledger; without one, the same harness's on the same dataset (other models); else the prior."""
    from dispatcher.driver.fleet import observe

    obs = observe(conn, spec.pool)
    if not obs.basis.startswith("prior"):
        return obs
    runs = [r for (r,) in conn.execute(
        "SELECT run FROM runs WHERE spec #>> '{harness,name}' = %s AND spec #>> '{instances,dataset}' = %s",
        (spec.harness.name, spec.instances.dataset))]
    conn.commit()
    if runs:
        other = observe(conn, spec.pool, runs=runs)
        if not other.basis.startswith("prior"):
            return other.model_copy(update={"basis": f"{spec.harness.name}'s ledger on this dataset with other"
                                                     f" models {other.basis.removeprefix('ledger ')}"})
    return obs


def start_seconds(conn: psycopg.Connection, spec) -> tuple[float, str]:
    """From a run's row to its first attempt's start, the median of the last runs of the same launcher."""
    rows = conn.execute(
        """SELECT extract(epoch FROM min(a.started_at) - r.created_at) FROM runs r JOIN attempts a USING (run)
           WHERE r.backend = %s AND coalesce(r.spec #>> '{backend,launcher}', '') = %s AND a.started_at IS NOT NULL
             AND a.calls > 0
           GROUP BY r.run, r.created_at ORDER BY r.created_at DESC LIMIT 20""",
        (spec.backend.kind, spec.backend.launcher or "")).fetchall()
    conn.commit()
    seen = [float(s) for (s,) in rows if s is not None and s >= 0]
    if not seen:
        return START_PRIOR_S, "prior"
    return statistics.median(seen), f"{len(seen)} earlier run(s) of the {spec.backend.launcher} launcher"


def images_to_build(conn: psycopg.Connection, plan) -> int:
    """The plan's instances with no task image of its harness recorded yet (those recorded are taken as reused),
    where `run` builds them (on AWS the build tier has built them before)."""
    from dispatcher import backends

    if not plan.in_task_images or not backends.for_spec(plan.spec).builds_images:
        return 0
    (found,) = conn.execute("SELECT count(DISTINCT instance_id) FROM task_images WHERE harness = %s"
                            " AND instance_id = ANY(%s)", (plan.spec.harness.name, list(plan.rows))).fetchone()
    conn.commit()
    return len(plan.rows) - found


def grading_after(attempts: int, first_end_s: float, attempts_s: float, obs: PoolObservation,
                  workers: int) -> float:
    """What grading adds after the last attempt ends: its own grading, or the graders' backlog when `workers`
    cannot keep up (they start when the first attempts end)."""
    graded = attempts * obs.graded_share
    if graded <= 0:
        return 0.0
    one = obs.grading_minutes * 60
    backlog_end = first_end_s + math.ceil(graded / workers) * one
    return max(one, backlog_end - attempts_s)


def make(conn: psycopg.Connection, plan, todo: int) -> Forecast:
    """The forecast of `todo` attempts of the plan's run."""
    from contract import compute_prices, pricing
    from contract.models import utcnow
    from dispatcher import images as task_images
    from dispatcher.driver.fleet import predict, predict_compute, size_gateway
    from dispatcher.launchers import launcher_class

    spec = plan.spec
    made_at = utcnow()
    obs = observation(conn, spec)
    limits, source = pool_limits(spec)
    try:
        price = pricing.price(spec.model.model, spec.model.provider)
    except pricing.UnknownModel:
        price = None
    paced = launcher_class(spec).paced  # a launcher paced to a quota (ECS) launches no faster than it
    p = predict(todo, limits, obs, price, spec.backend.concurrency, spec.budget.run_usd,
                spec.backend.launch_rate_per_s if paced else None, spec.backend.launch_burst)
    start_s, start_basis = start_seconds(conn, spec)
    grading_s = grading_after(todo, obs.attempt_minutes * 60, p.wall_time_s, obs, spec.eval.workers)
    to_build = images_to_build(conn, plan)
    build_s = (task_images.forecast_build(conn, spec.harness.name, to_build, spec.images.build_parallel).build_s
               if to_build else 0.0)
    compute = predict_compute(todo, obs, spec.backend.resources, compute_prices.load(), spec.backend.spot)
    return Forecast(
        made_at=made_at, attempts=todo, concurrency=p.concurrency,
        feedable=None if math.isinf(p.feedable) else p.feedable, limits=limits,
        limits_source=source, observation=obs, start_s=start_s, start_basis=start_basis, launch_s=p.launch_s,
        attempts_s=p.wall_time_s, grading_s=grading_s, images_to_build=to_build, image_build_s=build_s,
        wall_time_s=(build_s or 0.0) + start_s + p.wall_time_s + grading_s,
        token_usd=None if price is None else p.cost_usd, capped_by_budget=p.capped_by_budget, compute=compute,
        gateway=None if spec.gateway is None else size_gateway(p, obs, spec.gateway.replica_calls_per_s))


def record(conn: psycopg.Connection, run: str, forecast: Forecast) -> None:
    """Keep the forecast of a run about to start (one kept by a start that never made the run is replaced)."""
    conn.execute("INSERT INTO run_forecasts (run, made_at, forecast) VALUES (%s, %s, %s) ON CONFLICT (run) DO UPDATE"
                 " SET made_at = excluded.made_at, forecast = excluded.forecast",
                 (run, forecast.made_at, Jsonb(forecast.model_dump(mode="json"))))
    conn.commit()


def recorded(conn: psycopg.Connection, run: str) -> Forecast | None:
    row = conn.execute("SELECT forecast FROM run_forecasts WHERE run = %s", (run,)).fetchone()
    conn.commit()
    return Forecast.model_validate(row[0]) if row else None


def actual(conn: psycopg.Connection, run: str, since: datetime | None = None) -> Actual:
    """What the run took: its wall time from `since` (its forecast, made as `run` started; else the run's row) to
    its end, its tokens' cost and its compute's, priced as the results table prices them."""
    from dispatcher.report.outputs import fetch_attempts

    created, finished = conn.execute("SELECT created_at, finished_at FROM runs WHERE run = %s", (run,)).fetchone()
    conn.commit()
    rows = fetch_attempts(conn, run)
    wall = (finished - (since or created)).total_seconds() if finished else None
    return Actual(wall_time_s=wall, token_usd=float(sum(r["cost_usd"] or 0 for r in rows)),
                  compute_usd=float(sum(r["compute_usd"] for r in rows)))


class Line(BaseModel):
    label: str
    predicted: float | None
    actual: float | None
    unit: str  # "min" or "$"

    def text(self, value: float | None) -> str:
        return "–" if value is None else (f"{value:.1f} min" if self.unit == "min" else f"${value:.4f}")

    @property
    def ratio(self) -> float | None:
        """actual / predicted (None where either is unknown or the prediction is 0)."""
        return self.actual / self.predicted if self.predicted and self.actual is not None else None


def against(f: Forecast, a: Actual) -> list[Line]:
    """The forecast's figures beside the run's."""
    minutes = None if a.wall_time_s is None else a.wall_time_s / 60
    return [Line(label="wall time", predicted=f.wall_time_s / 60, actual=minutes, unit="min"),
            Line(label="token cost", predicted=f.token_usd, actual=a.token_usd, unit="$"),
            Line(label="compute cost", predicted=f.compute.total_usd, actual=a.compute_usd, unit="$"),
            Line(label="total cost", predicted=f.total_usd, actual=a.total_usd, unit="$")]
