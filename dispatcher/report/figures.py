"""A run's figures, from its rows (attempts, phases) and its ledger (calls): money in exact decimals, as
PostgreSQL sums it (numeric), so every cost figure is the ledger's to the micro-dollar.

Scored attempts are the ones the model answers for: RESOLVED, UNRESOLVED, EMPTY_PATCH, EVAL_ERROR. Infrastructure
failures, cancelled attempts and patches still waiting for the grader are counted, never scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import psycopg
from pydantic import BaseModel

from dispatcher.report.stats import PassAtK, pass_at_ks

SCORED = ("RESOLVED", "UNRESOLVED", "EMPTY_PATCH", "EVAL_ERROR")
MICRO = Decimal("0.000001")


class NoSuchRun(LookupError):
    pass


class AttemptFigures(BaseModel):
    instance_id: str
    attempt: int
    status: str
    outcome: str
    calls: int
    input_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    output_tokens: int
    cost_usd: Decimal  # the ledger's sum for this attempt
    wall_time_s: float | None
    started_at: datetime | None
    ended_at: datetime | None
    tamper_flags: list[dict] = []  # eval_worker.tamper: [{"rule", "files"}], beside the official status


class InstanceFigures(BaseModel):
    instance_id: str
    attempts: int
    scored: int
    resolved: int
    statuses: list[str]  # by attempt number
    cost_usd: Decimal


class CostFigures(BaseModel):
    total_usd: Decimal  # every call of the run in the ledger
    per_attempt_usd: Decimal | None  # total / attempts landed
    per_instance_usd: Decimal | None  # total / instances
    per_resolved_instance_usd: Decimal | None  # total / instances resolved by at least one attempt


class TokenFigures(BaseModel):
    input_tokens: int  # uncached input
    cached_tokens: int
    cache_write_tokens: int
    output_tokens: int
    cache_hit_rate: float | None  # cached / all prompt tokens (uncached + cached + cache writes)


class CallFigures(BaseModel):
    calls: int
    by_outcome: dict[str, int]
    retries: int  # upstream retries, summed over calls
    calls_retried: int
    latency_ms_p50: float | None
    latency_ms_p90: float | None
    latency_ms_p99: float | None
    pacer_wait_share: float | None  # pacer wait / call time (a call's latency includes its wait)


class TimeFigures(BaseModel):
    """Where the time went, summed over attempts (seconds)."""

    wall_clock_s: float | None  # first attempt's start to the last attempt's or grading's end
    harness_s: float  # the harness phases
    model_s: float  # inside calls, less the pacer wait
    pacer_wait_s: float
    agent_s: float  # the rest of the harness phases: tools, the agent itself, setup
    grading_queue_s: float  # enqueued for grading to grading started
    grading_s: float


class RunFigures(BaseModel):
    run: str
    state: str
    model: str
    harness: str
    pool: str
    backend: str
    run_cap_usd: Decimal | None
    created_at: datetime
    finished_at: datetime | None
    planned: int
    landed: int
    instances: int
    statuses: dict[str, int]
    scored: int
    resolved: int
    resolved_instances: int
    cost: CostFigures
    tokens: TokenFigures
    calls: CallFigures
    time: TimeFigures
    pass_at: list[PassAtK]
    attempts: list[AttemptFigures]
    instances_detail: list[InstanceFigures]

    def outcomes(self) -> dict[str, tuple[int, int]]:
        """instance -> (scored attempts, resolved): what pass@k and the paired comparison take."""
        return {i.instance_id: (i.scored, i.resolved) for i in self.instances_detail}

    def first_scored(self) -> dict[str, bool]:
        """instance -> whether its first scored attempt resolved it (McNemar's pairs)."""
        out: dict[str, bool] = {}
        for a in sorted(self.attempts, key=lambda a: (a.instance_id, a.attempt)):
            if a.status in SCORED and a.instance_id not in out:
                out[a.instance_id] = a.status == "RESOLVED"
        return out


@dataclass
class Series:
    """Time series for the plots (not part of the JSON summary: one point per call)."""

    call_end: list[datetime]  # when each call ended, in order
    call_cost: list[Decimal]
    spans: list[tuple[datetime, datetime]]  # each attempt's harness phase


def _div(total: Decimal, n: int) -> Decimal | None:
    return (total / n).quantize(Decimal("0.000000001")) if n else None


def load(conn: psycopg.Connection, run: str) -> tuple[RunFigures, Series]:
    row = conn.execute("SELECT spec, status, attempts, created_at, finished_at, backend FROM runs WHERE run = %s",
                       (run,)).fetchone()
    if row is None:
        raise NoSuchRun(f"no run named {run!r}")
    spec, state, planned, created_at, finished_at, backend = row
    model = spec.get("model", {})
    harness = spec.get("harness", {}).get("name", "")
    cap = spec.get("budget", {}).get("run_usd")

    ledger = {(r[0], r[1]): r[2:] for r in conn.execute(
        """SELECT instance_id, attempt, count(*), sum(input_tokens), sum(cached_tokens), sum(cache_write_tokens),
                  sum(output_tokens), sum(cost_usd), sum(retries), count(*) FILTER (WHERE retries > 0),
                  sum(pacer_wait_ms), sum(latency_ms)
           FROM calls WHERE run = %s GROUP BY instance_id, attempt""", (run,))}
    attempts = []
    for iid, n, status, outcome, wall, started, ended, flags in conn.execute(
            """SELECT instance_id, attempt, status, outcome, wall_time_s, started_at, ended_at, tamper_flags
               FROM attempts WHERE run = %s ORDER BY instance_id, attempt""", (run,)):
        calls, i, c, w, o, cost, *_ = ledger.get((iid, n), (0, 0, 0, 0, 0, Decimal(0)))
        attempts.append(AttemptFigures(instance_id=iid, attempt=n, status=status, outcome=outcome, calls=calls,
                                       input_tokens=i, cached_tokens=c, cache_write_tokens=w, output_tokens=o,
                                       cost_usd=cost, wall_time_s=wall, started_at=started, ended_at=ended,
                                       tamper_flags=flags or []))

    sums = [sum((v[j] for v in ledger.values()), start=Decimal(0) if j == 5 else 0) for j in range(10)]
    n_calls, t_in, t_cached, t_write, t_out, total, retries, retried, wait_ms, latency_ms = sums
    by_outcome = dict(conn.execute("SELECT outcome, count(*) FROM calls WHERE run = %s GROUP BY outcome", (run,)))
    p50, p90, p99 = conn.execute(
        "SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY latency_ms) FROM calls WHERE run = %s",
        (run,)).fetchone()[0] or (None, None, None)

    per_instance: dict[str, list[AttemptFigures]] = {}
    for a in attempts:
        per_instance.setdefault(a.instance_id, []).append(a)
    instances = [InstanceFigures(instance_id=iid, attempts=len(ats), scored=sum(a.status in SCORED for a in ats),
                                 resolved=sum(a.status == "RESOLVED" for a in ats), statuses=[a.status for a in ats],
                                 cost_usd=sum((a.cost_usd for a in ats), start=Decimal(0)))
                 for iid, ats in sorted(per_instance.items())]
    statuses: dict[str, int] = {}
    for a in attempts:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    resolved_instances = sum(1 for i in instances if i.resolved)
    prompt = t_in + t_cached + t_write

    phases = conn.execute(
        """SELECT p.started_at, p.ended_at, a.eval_enqueued_at FROM phases p JOIN attempts a USING (run, instance_id,
           attempt) WHERE p.run = %s AND p.phase = 'eval'""", (run,)).fetchall()
    grading_s = sum((e - s).total_seconds() for s, e, _ in phases if s and e)
    queue_s = sum(max(0.0, (s - q).total_seconds()) for s, _, q in phases if s and q)
    harness_s = sum(a.wall_time_s or 0.0 for a in attempts)
    model_s = float(latency_ms - wait_ms) / 1000
    starts = [a.started_at for a in attempts if a.started_at]
    ends = [a.ended_at for a in attempts if a.ended_at] + [e for _, e, _ in phases if e]
    figures = RunFigures(
        run=run, state=state, model=model.get("model", ""), harness=harness,
        pool=model.get("pool") or f"{model.get('model', '')}@{harness}", backend=backend,
        run_cap_usd=Decimal(str(cap)) if cap is not None else None, created_at=created_at, finished_at=finished_at,
        planned=planned, landed=len(attempts), instances=len(instances), statuses=statuses,
        scored=sum(i.scored for i in instances), resolved=sum(i.resolved for i in instances),
        resolved_instances=resolved_instances,
        cost=CostFigures(total_usd=total, per_attempt_usd=_div(total, len(attempts)),
                         per_instance_usd=_div(total, len(instances)),
                         per_resolved_instance_usd=_div(total, resolved_instances)),
        tokens=TokenFigures(input_tokens=t_in, cached_tokens=t_cached, cache_write_tokens=t_write,
                            output_tokens=t_out, cache_hit_rate=t_cached / prompt if prompt else None),
        calls=CallFigures(calls=n_calls, by_outcome=by_outcome, retries=retries, calls_retried=retried,
                          latency_ms_p50=p50, latency_ms_p90=p90, latency_ms_p99=p99,
                          pacer_wait_share=float(wait_ms / latency_ms) if latency_ms else None),
        time=TimeFigures(wall_clock_s=(max(ends) - min(starts)).total_seconds() if starts and ends else None,
                         harness_s=harness_s, model_s=model_s, pacer_wait_s=float(wait_ms) / 1000,
                         agent_s=max(0.0, harness_s - float(latency_ms) / 1000), grading_queue_s=queue_s,
                         grading_s=grading_s),
        pass_at=pass_at_ks({i.instance_id: (i.scored, i.resolved) for i in instances if i.scored}),
        attempts=attempts, instances_detail=instances,
    )
    calls = conn.execute(
        "SELECT started_at + make_interval(secs => latency_ms / 1000), cost_usd FROM calls WHERE run = %s"
        " ORDER BY 1", (run,)).fetchall()
    conn.commit()
    series = Series(call_end=[c[0] for c in calls], call_cost=[c[1] for c in calls],
                    spans=[(a.started_at, a.ended_at) for a in attempts if a.started_at and a.ended_at])
    return figures, series
