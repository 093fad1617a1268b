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

from contract import compute_prices
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
    slot: int = 0  # the attempt number it counts under (a retry's: the one it relaunched); 0: its own
    superseded: bool = False  # a retry of its slot landed: kept and shown, not counted
    # the task's resources as recorded, what its container counted, and its grading (None: not recorded)
    task_cpu: float | None = None
    task_memory_mib: int | None = None
    task_memory_limit_mib: int | None = None
    task_cpu_s: float | None = None
    task_memory_peak_bytes: int | None = None
    task_wall_s: float | None = None
    task_capacity: str | None = None  # on_demand or spot, where the launcher saw it (ECS)
    grading_wall_s: float | None = None
    grading_cpu_s: float | None = None
    compute_usd: Decimal = Decimal(0)  # the recorded figures x the compute price table (contract.compute_prices)

    @property
    def total_usd(self) -> Decimal:
        return self.cost_usd + self.compute_usd


ATTEMPT_COMPUTE = ("task_cpu", "task_memory_mib", "task_memory_limit_mib", "task_cpu_s", "task_memory_peak_bytes",
                   "task_wall_s", "task_capacity", "grading_wall_s", "grading_cpu_s")


def usd_of(value: float | None) -> Decimal:
    return Decimal(0) if value is None else Decimal(str(round(value, 9)))


def compute_usd(row: dict) -> Decimal:
    """An attempt row's compute cost: its recorded figures x the price table."""
    return usd_of(compute_prices.load().attempt(row).total_usd)


def resources_text(cpu: float | None, memory_mib: int | None, limit_mib: int | None) -> str:
    """`1 vCPU, 4096 MiB (limit 6144 MiB)`, as recorded ("–" where not)."""
    if cpu is None:
        return "–"
    limit = f" (limit {limit_mib} MiB)" if limit_mib and limit_mib != memory_mib else ""
    return f"{cpu:g} vCPU, {memory_mib} MiB{limit}"


class InstanceFigures(BaseModel):
    instance_id: str
    attempts: int
    scored: int
    resolved: int
    statuses: list[str]  # by attempt number
    cost_usd: Decimal
    compute_usd: Decimal = Decimal(0)


class CostLine(BaseModel):
    total_usd: Decimal
    per_attempt_usd: Decimal | None  # total / attempts landed
    per_instance_usd: Decimal | None  # total / instances
    per_resolved_instance_usd: Decimal | None  # total / instances resolved by at least one attempt

    @classmethod
    def of(cls, total: Decimal, attempts: int, instances: int, resolved_instances: int) -> CostLine:
        return cls(total_usd=total, per_attempt_usd=_div(total, attempts), per_instance_usd=_div(total, instances),
                   per_resolved_instance_usd=_div(total, resolved_instances))


class CostFigures(CostLine):
    """Tokens (the ledger: every call of the run) in the top-level fields; compute (tasks and gradings, priced from
    their recorded figures) and the two together beside them."""

    compute: CostLine
    combined: CostLine
    compute_prices: str  # the price table's sources and dates


def cost_figures(tokens: Decimal, compute: Decimal, attempts: int, instances: int, resolved: int) -> CostFigures:
    """Tokens, compute and their total, per attempt, instance and resolved instance (the report, the results table)."""
    p = compute_prices.load()
    (od_vcpu, od_gb), (spot_vcpu, spot_gb) = p.task.rates("on_demand"), p.task.rates("spot")
    basis = (f"tasks: Fargate ${od_vcpu}/vCPU-h, ${od_gb}/GB-h, Spot ${spot_vcpu}/vCPU-h, ${spot_gb}/GB-h"
             f" (unrecorded capacity: {p.task.capacity}; {p.task.date});"
             f" grading: {p.grading.instance_type} ${p.grading.instance_hour}/h shared by {p.grading.gradings_per_instance}"
             f" gradings ({p.grading.date}); {compute_prices.price_file().name}")
    return CostFigures(**CostLine.of(tokens, attempts, instances, resolved).model_dump(),
                       compute=CostLine.of(compute, attempts, instances, resolved),
                       combined=CostLine.of(tokens + compute, attempts, instances, resolved), compute_prices=basis)


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
    task_cpu_s: float | None = None  # what the tasks' containers counted, summed (None: none recorded)
    task_wall_s: float | None = None


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
    resources: list[str]  # the task resources its attempts recorded (one entry per distinct setting)
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
        for a in sorted(self.attempts, key=lambda a: (a.instance_id, a.slot or a.attempt)):
            if a.status in SCORED and a.instance_id not in out and not a.superseded:
                out[a.instance_id] = a.status == "RESOLVED"
        return out


@dataclass
class Series:
    """Time series for the plots (not part of the JSON summary: one point per call)."""

    call_end: list[datetime]  # when each call ended, in order
    call_cost: list[Decimal]
    spans: list[tuple[datetime, datetime]]  # each attempt's harness phase


def _summed(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


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
    cur = conn.execute(
        f"""SELECT instance_id, attempt, v.slot, v.superseded, v.status, outcome, wall_time_s, started_at, ended_at,
                   tamper_flags, {", ".join(ATTEMPT_COMPUTE)}
            FROM attempts a JOIN attempt_verdicts v USING (run, instance_id, attempt)
            WHERE run = %s ORDER BY instance_id, attempt""", (run,))
    names = [d.name for d in cur.description]
    for values in cur:
        a = dict(zip(names, values))
        calls, i, c, w, o, cost, *_ = ledger.get((a["instance_id"], a["attempt"]), (0, 0, 0, 0, 0, Decimal(0)))
        attempts.append(AttemptFigures(**a | {"tamper_flags": a["tamper_flags"] or []}, calls=calls, input_tokens=i,
                                       cached_tokens=c, cache_write_tokens=w, output_tokens=o, cost_usd=cost,
                                       compute_usd=compute_usd(a)))

    sums = [sum((v[j] for v in ledger.values()), start=Decimal(0) if j == 5 else 0) for j in range(10)]
    n_calls, t_in, t_cached, t_write, t_out, total, retries, retried, wait_ms, latency_ms = sums
    by_outcome = dict(conn.execute("SELECT outcome, count(*) FROM calls WHERE run = %s GROUP BY outcome", (run,)))
    p50, p90, p99 = conn.execute(
        "SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY latency_ms) FROM calls WHERE run = %s",
        (run,)).fetchone()[0] or (None, None, None)

    per_instance: dict[str, list[AttemptFigures]] = {}  # pass@k and the statuses count slots, not retries
    counted = [a for a in attempts if not a.superseded]
    for a in counted:
        per_instance.setdefault(a.instance_id, []).append(a)
    instances = [InstanceFigures(instance_id=iid, attempts=len(ats), scored=sum(a.status in SCORED for a in ats),
                                 resolved=sum(a.status == "RESOLVED" for a in ats), statuses=[a.status for a in ats],
                                 cost_usd=sum((a.cost_usd for a in ats), start=Decimal(0)),
                                 compute_usd=sum((a.compute_usd for a in ats), start=Decimal(0)))
                 for iid, ats in sorted(per_instance.items())]
    statuses: dict[str, int] = {}
    for a in counted:
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
        resources=sorted({resources_text(a.task_cpu, a.task_memory_mib, a.task_memory_limit_mib) for a in attempts}),
        scored=sum(i.scored for i in instances), resolved=sum(i.resolved for i in instances),
        resolved_instances=resolved_instances,
        cost=cost_figures(total, sum((a.compute_usd for a in attempts), start=Decimal(0)), len(attempts),
                          len(instances), resolved_instances),
        tokens=TokenFigures(input_tokens=t_in, cached_tokens=t_cached, cache_write_tokens=t_write,
                            output_tokens=t_out, cache_hit_rate=t_cached / prompt if prompt else None),
        calls=CallFigures(calls=n_calls, by_outcome=by_outcome, retries=retries, calls_retried=retried,
                          latency_ms_p50=p50, latency_ms_p90=p90, latency_ms_p99=p99,
                          pacer_wait_share=float(wait_ms / latency_ms) if latency_ms else None),
        time=TimeFigures(wall_clock_s=(max(ends) - min(starts)).total_seconds() if starts and ends else None,
                         harness_s=harness_s, model_s=model_s, pacer_wait_s=float(wait_ms) / 1000,
                         agent_s=max(0.0, harness_s - float(latency_ms) / 1000), grading_queue_s=queue_s,
                         grading_s=grading_s, task_cpu_s=_summed(a.task_cpu_s for a in attempts),
                         task_wall_s=_summed(a.task_wall_s for a in attempts)),
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
