"""Throughput against the provider's limits: how close a run comes to the bound its pool's limits set (issue 37).

    .venv/bin/python bench/bench_throughput.py                       # spec and discovered sections, 48 attempts
    .venv/bin/python bench/bench_throughput.py --full                # every section, 480 attempts a run
    .venv/bin/python bench/bench_throughput.py --sections halved shared --attempts 240

The real dispatcher (spec -> plan -> DriverLoop, its Planner, the PoolPacer Ray actor, two ResultsWriter actors,
PostgreSQL, Valkey; S3 and SQS stand-ins) launches bench/agent_fleet.py's tasks: each a real shim (GCRA pacing in
Valkey, retries, ledger) in front of the provider simulator, and a simulated agent that follows the simulator's
seeded trajectory policy (turns, growing input read from the prompt cache, reply sizes, think time). The simulator
enforces rpm and itpm limits that the fleet (backend.concurrency) could exceed several times over.

Time is not compressed: limits are per real minute; the trajectories are short (tens of seconds an attempt, where
real ones take minutes), so that a run whose limits bind fits in a few minutes.

Per section it prints: wall time; the bound of each limited dimension (the run's total over the limit) and the ratio
of wall time to the largest; the limit used per minute; the pacer-wait share of task time; task-seconds waiting on
the pacer vs the rest; 429s surfaced to an agent (must be 0) and absorbed by the shims. Sections:
  spec        limits known from the spec (wall / bound <= 1.15; limit used >= 90% in the steady state);
  discovered  no limits in the spec: the shims discover them from the provider's headers (wall / bound <= 1.25);
  halved      the provider halves its limits mid-run, and restores them later: the rate follows down and back up
              within two minutes, no 429 surfaced;
  shared      two runs on one pool at once: each gets 40-60% of the limit over their overlap, the pair's wall / bound
              <= 1.2.
`--plot FILE.svg` draws the first section's limit used and fleet size over time (docs/planner.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx
import psycopg
from bench_dispatch import BASE_DB, make_database, start_aws, write_run

MODEL = "claude-sonnet-4-5"
KEY = "sk-bench-" + uuid.uuid4().hex
LIMITS = {"rpm": 600, "itpm": 650_000}  # what the simulated provider enforces (otpm: far from binding)
OTPM = 2_000_000
MAX_TOKENS = 1024
BIN_S = 60.0
RESULTS: list[tuple[str, str, bool]] = []


def verdict(name: str, value: str, ok: bool) -> None:
    RESULTS.append((name, value, ok))
    print(f"  {'PASS' if ok else 'MISS'}  {name}: {value}", flush=True)


@dataclass
class Section:
    """What one section measured, for its figures (and the plot)."""

    name: str
    runs: list[str]
    start: float
    end: float = 0.0
    all_launched: float = 0.0  # when the last attempt was launched (the drain starts)
    fleet: list[tuple[float, int, int]] = field(default_factory=list)  # (t, tasks running, planner target)
    paced: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (t, the limits the pool is paced at)
    tasks: list[dict] = field(default_factory=list)
    limit_changes: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (t, provider limits from t)
    rejected_429: int = 0

    def limit_at(self, t: float) -> dict[str, int]:
        now = self.limit_changes[0][1]
        for at, limits in self.limit_changes:
            if at <= t:
                now = limits
        return now


class Provider:
    """The simulator as a subprocess: its limits (changeable), its count of 429s."""

    def __init__(self, url: str, limits: dict[str, int]):
        self.url, self.base, self.limits = url, dict(limits), dict(limits)

    def set_limits(self, limits: dict[str, int]) -> None:
        httpx.post(self.url + "/_sim/limits", json=limits | {"otpm": OTPM}).raise_for_status()
        self.limits = dict(limits)

    def reset(self) -> None:
        httpx.post(self.url + "/_sim/reset").raise_for_status()
        self.set_limits(self.base)

    def refused(self) -> int:
        models = httpx.get(self.url + "/_sim/stats").json()["models"]
        return sum(int(m["errors"].get("429", 0)) for m in models.values())


class BenchRun:
    """One run through the real dispatcher (a DriverLoop stepped by the caller)."""

    def __init__(self, tmp: Path, n: int, pool: str, known: dict[str, int] | None, concurrency: int, upstream: str,
                 valkey_url: str, dataset: Path):
        """known: the limits the spec states (None: none, they are discovered); dataset: the instances' folder
        (runs given the same one forecast from each other's ledger)."""
        import redis
        from agent_fleet import STATEMENT_CHARS, AgentLauncher

        from contract import db
        from contract.signing import RunKeys
        from dispatcher import backends, forecast
        from dispatcher.backends import daemons, resources
        from dispatcher.backends.base import attempt_env
        from dispatcher.driver import loop as runmod
        from dispatcher.driver.actors import PoolPacer, ResultsWriterActor
        from dispatcher.plan import make_plan
        from dispatcher.spec import load_spec

        limits = "".join(f"{k} = {v}\n" for k, v in known.items()) + f"otpm = {OTPM}\n" if known else ""
        spec_path = write_run(tmp, n, concurrency, 60.0, pool=pool, model=f"max_tokens = {MAX_TOKENS}\n{limits}",
                              budget="attempt_usd = 100\nmax_turns = 500", statement=" context" * (STATEMENT_CHARS // 8),
                              dataset=dataset)
        self.plan = plan = make_plan(load_spec(spec_path))
        spec = plan.spec
        self.name, self.conn = spec.run.name, db.connect()
        db.migrate(self.conn)
        self.forecast = forecast.make(self.conn, plan, len(plan.refs))  # as `run` makes it, before anything starts
        forecast.record(self.conn, self.name, self.forecast)
        runmod.open_run(self.conn, plan)
        res = resources.ensure(spec.run.name)
        key_files = (str(tmp / "run.key"), str(backends.for_spec(spec).verdict_key_file()))
        run_keys = RunKeys.load(*key_files)
        aws_env = daemons.aws_env()
        runmod.ray_init(False, aws_env)
        self.writers = [ResultsWriterActor.options(name=f"results-writer:{self.name}:{i}").remote(
            res.model_dump(), db.database_url(), aws_env, 60.0, key_files) for i in range(spec.backend.writer_count)]
        pacer = PoolPacer.options(name=f"pacer:{spec.pool}", get_if_exists=True).remote(
            spec.pool, valkey_url, {"rpm": spec.model.rpm, "itpm": spec.model.itpm, "otpm": spec.model.otpm})
        self.launcher = AgentLauncher(KEY, tmp / "tasks", aws_env | {"DATABASE_URL": db.database_url()},
                                      spec.model.max_tokens, attempt_env(run_keys))
        self.loop = runmod.DriverLoop(plan, res, self.conn, redis.Redis.from_url(valkey_url), self.launcher, pacer,
                                      lambda ref: runmod.make_job(plan, res, ref, upstream, valkey_url), run_keys)
        self.loop.PLAN_EVERY_S = 5.0
        self.done_at: float | None = None

    def step(self) -> bool:
        if self.done_at is None and self.loop.step():
            from dispatcher import store

            self.done_at = time.time()
            store.finish(self.conn, self.name)  # as the driver ends a run: the time its forecast is held to
        return self.done_at is not None

    @property
    def active(self) -> int:
        return sum(1 for t in self.loop.running.values() if t.exit_code is None)

    def close(self) -> None:
        import ray

        self.launcher.drain()
        ray.get([w.stop.remote() for w in self.writers])
        self.launcher.close()
        self.conn.close()


def drive(section: Section, runs: list[BenchRun], provider: Provider, schedule: list[tuple[float, dict]]) -> None:
    """Step the runs to their end, applying the provider's limit changes at their times (seconds from the start)."""
    last_print = 0.0
    while True:
        now = time.time()
        while schedule and now - section.start >= schedule[0][0]:
            _, limits = schedule.pop(0)
            provider.set_limits(limits)
            section.limit_changes.append((now, limits))
            print(f"  {now - section.start:6.0f}s the provider's limits are now {limits}", file=sys.stderr, flush=True)
        done = [r.step() for r in runs]
        section.fleet.append((now, sum(r.active for r in runs), sum(r.loop.target for r in runs)))
        section.paced.append((now, dict(runs[0].loop.limits)))
        if not section.all_launched and all(r.launcher.launched >= len(r.plan.refs) for r in runs):
            section.all_launched = now
        if all(done):
            break
        if now - last_print > 15:
            landed = sum(sum(r.loop.counts.values()) for r in runs)
            obs = runs[0].loop.observed
            seen = f"turn {obs.turn_s or 0:.1f} s, pacer wait {obs.pacer_wait_share:.0%}" if obs else ""
            print(f"  {now - section.start:6.0f}s landed {landed}, running {section.fleet[-1][1]}, target"
                  f" {section.fleet[-1][2]}, limits {runs[0].loop.limits}; {seen}; load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
            last_print = now
        time.sleep(0.25)
    section.end = max(r.done_at or now for r in runs)
    for r in runs:  # a task reports after its result landed, which may have ended the run: wait for every report
        deadline = time.monotonic() + 30
        r.launcher.drain()
        while len(r.launcher.tasks) < r.launcher.launched and time.monotonic() < deadline:
            time.sleep(0.1)
            r.launcher.drain()
        section.tasks += r.launcher.tasks


def calls_of(conn, runs: list[str]) -> list[tuple[str, float, float, int, int]]:
    """(run, when the call went upstream (epoch s), pacer wait s, tokens toward itpm, output tokens) per call."""
    rows = conn.execute(
        "SELECT run, extract(epoch FROM started_at) + pacer_wait_ms / 1000, pacer_wait_ms / 1000,"
        " input_tokens + cache_write_tokens, output_tokens FROM calls WHERE run = ANY(%s) AND outcome = 'ok'",
        (runs,)).fetchall()
    conn.commit()
    return [(r, float(t), float(w), int(i), int(o)) for r, t, w, i, o in rows]


def usage_bins(section: Section, calls: list, run: str | None = None) -> list[dict[str, float]]:
    """Per BIN_S window from the section's start: each dimension's use over the provider's limit then."""
    n = max(1, int((section.end - section.start) // BIN_S) + 1)
    used = [{"rpm": 0.0, "itpm": 0.0} for _ in range(n)]
    for r, t, _, inp, _ in calls:
        if run is not None and r != run:
            continue
        b = min(n - 1, max(0, int((t - section.start) // BIN_S)))
        used[b]["rpm"] += 1
        used[b]["itpm"] += inp
    out = []
    for b, u in enumerate(used):
        lim = section.limit_at(section.start + (b + 0.5) * BIN_S)
        out.append({d: u[d] / (lim[d] * BIN_S / 60) for d in u})
    return out


def landing_lag(conn, section: Section) -> float:
    exited = {(t["instance_id"], t["attempt"]): t["exited"] for t in section.tasks}
    rows = conn.execute("SELECT instance_id, attempt, extract(epoch FROM landed_at) FROM attempts WHERE run = ANY(%s)",
                        (section.runs,)).fetchall()
    conn.commit()
    lags = [float(at) - exited[(i, a)] for i, a, at in rows if (i, a) in exited]
    return statistics.median(lags) if lags else float("nan")


def report(section: Section, conn, ratio_target: float | None) -> dict:
    """Print the section's figures; returns them."""
    calls = calls_of(conn, section.runs)
    wall = section.end - section.start
    totals = {"rpm": len(calls), "itpm": sum(c[3] for c in calls)}
    limits = section.limit_changes[0][1]
    bounds = {d: totals[d] / limits[d] * 60 for d in totals}
    binding = max(bounds, key=bounds.get)
    task_s = sum(t["exited"] - t["launched"] for t in section.tasks)
    # the tail: once the limits' work is done the fleet drains as its last attempts end, at best half an attempt
    tail = statistics.median(t["exited"] - t["launched"] for t in section.tasks) / 2 if section.tasks else 0.0
    bound = bounds[binding] + tail
    wait_s = sum(c[2] for c in calls)
    surfaced = sum(sum(t.get("not_ok", {}).values()) for t in section.tasks)
    failed = [t for t in section.tasks if "error" in t]
    bins = usage_bins(section, calls)
    used = [max(b.values()) for b in bins]
    # the steady state: full minutes from a minute after the first call (the planner has seen turns) until every
    # attempt is launched (the drain)
    first = min(c[1] for c in calls) - section.start if calls else 0.0
    steady = [u for i, u in enumerate(used)
              if i * BIN_S >= first + BIN_S and (i + 1) * BIN_S <= section.all_launched - section.start]
    print(f"[{section.name}] {len(section.tasks)} attempts ({len(failed)} failed tasks), {totals['rpm']} calls,"
          f" {totals['itpm']:,} tokens toward itpm; provider limits {limits}")
    print(f"  wall time {wall:.0f} s; each dimension's total / its limit: " + ", ".join(
        f"{d} {b:.0f} s" for d, b in bounds.items()) + f"; the tail (half a median attempt's {2 * tail:.0f} s)"
          f" {tail:.0f} s; bound {bound:.0f} s; wall / bound {wall / bound:.3f} (without the tail:"
          f" {wall / bounds[binding]:.3f})")
    print("  limit used per minute (the binding dimension's share of its limit): "
          + " ".join(f"{u:.0%}" for u in used) + f"; all attempts launched at {section.all_launched - section.start:.0f} s")
    print(f"  pacer wait {wait_s:.0f} task-s of {task_s:.0f} task-s ({wait_s / max(task_s, 1e-9):.1%}); working or"
          f" starting {task_s - wait_s:.0f} task-s; fleet peak {max(f[1] for f in section.fleet)}")
    print(f"  429s surfaced to an agent {surfaced}, absorbed by the shims {section.rejected_429}")
    ok = [t for t in section.tasks if "agent_start" in t]
    if ok:
        print("  a task's time, median: starting (job, shim) {:.1f} s, agent {:.1f} s (its own work {:.1f} s), ending"
              " (shim stop, result sent) {:.1f} s; a row landed after its task's exit (median) {:.1f} s".format(
                  statistics.median(t["agent_start"] - t["launched"] for t in ok),
                  statistics.median(t["agent_end"] - t["agent_start"] for t in ok),
                  statistics.median(t["think_s"] for t in ok),
                  statistics.median(t["exited"] - t["agent_end"] for t in ok), landing_lag(conn, section)))
    if failed:
        print(f"  failed tasks, first: {failed[0]['error']}")
    if ratio_target is not None:
        verdict(f"{section.name}: wall / bound", f"{wall / bound:.3f} (target <= {ratio_target})",
                wall / bound <= ratio_target)
        share = min(steady) if steady else 0.0
        verdict(f"{section.name}: limit used in the steady state (each full minute from a minute after the first"
                f" call until all are launched)",
                f"min {share:.0%} over {len(steady)} minutes (target >= 90%)", bool(steady) and share >= 0.9)
    verdict(f"{section.name}: pacer-wait share of task time", f"{wait_s / max(task_s, 1e-9):.1%} (target <= 10%)",
            wait_s <= 0.1 * task_s)
    verdict(f"{section.name}: 429s surfaced", f"{surfaced} (target 0); {len(failed)} tasks failed",
            surfaced == 0 and not failed)
    forecasts = forecast_against(section, conn, judged=ratio_target is not None and section.name != "discovered")
    return {"wall": wall, "bound": bound, "bins": bins, "calls": calls, "forecasts": forecasts}


def forecast_against(section: Section, conn, judged: bool) -> dict[str, list]:
    """Each run's forecast (made as `run` makes it) against what it took. judged: the forecast could know the run's
    conditions (limits stated in the spec, unchanged, one run on the pool) and had a ledger to read: within 25%."""
    from dispatcher import forecast

    out = {}
    for run in section.runs:
        f = forecast.recorded(conn, run)
        lines = forecast.against(f, forecast.actual(conn, run, since=f.made_at))
        out[run] = lines
        print(f"  forecast of {run} (call shape from the {f.observation.basis}; limits from {f.limits_source}): "
              + "; ".join(f"{ln.label} {ln.text(ln.predicted)} predicted, {ln.text(ln.actual)} actual"
                          + (f" (actual / predicted {ln.ratio:.2f})" if ln.ratio else "") for ln in lines[:2]))
        if judged and not f.observation.basis.startswith("prior") and len(section.runs) == 1:
            for ln in lines[:2]:
                verdict(f"{section.name}: forecast {ln.label}, actual / predicted",
                        f"{ln.ratio:.2f} (target 0.75-1.25)" if ln.ratio else "not known",
                        ln.ratio is not None and 0.75 <= ln.ratio <= 1.25)
    return out


def run_section(name: str, tmp: Path, n: int, provider: Provider, valkey_url: str, concurrency: int,
                known: bool = True, schedule: list[tuple[float, dict]] | None = None, shared: int = 1) -> Section:
    provider.reset()
    pool = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    before = provider.refused()
    # a run's instances are those of the same run of every section (their attempts replay the same trajectories):
    # each section forecasts from the ledger of the sections before it
    runs = [BenchRun(tmp / f"{name}-{i}", n // shared, pool, provider.base if known else None, concurrency,
                     provider.url, valkey_url, tmp / f"dataset-{n // shared}-{i}")
            for i in range(shared)]
    section = Section(name, [r.name for r in runs], time.time())
    section.limit_changes.append((section.start, dict(provider.base)))
    try:
        drive(section, runs, provider, list(schedule or []))
    except BaseException:
        for r in runs:
            r.launcher.proc.terminate()  # its shims with it (AgentFleet)
        raise
    for r in runs:
        r.close()
    section.rejected_429 = provider.refused() - before
    return section


def followed(section: Section, calls: list, window_s: float = 120.0) -> None:
    """After each limit change: how soon the pool's pace (the PoolPacer's itpm) came to at most the new limit (down)
    or within 15% under it (up), and the rate used (itpm per 20 s) with it."""
    for at, limits in section.limit_changes[1:]:
        new = limits["itpm"]
        lower = new < section.limit_changes[0][1]["itpm"]
        paced = [(t - at, p.get("itpm", 0)) for t, p in section.paced if t >= at]
        within = next((dt for dt, p in paced if (0 < p <= new if lower else p >= 0.85 * new)), None)
        rates = [sum(c[3] for c in calls if at + k * 20 <= c[1] < at + k * 20 + 20) * 3 / new
                 for k in range(int(window_s * 1.5 // 20))]
        verdict(f"{section.name}: the pace follows the provider's itpm to {new:,}",
                f"within {within if within is None else round(within)} s (target <= {window_s:.0f} s); itpm used /"
                f" the new limit per 20 s after the change: " + " ".join(f"{r:.0%}" for r in rates),
                within is not None and within <= window_s)


def shares(section: Section, calls: list) -> None:
    """Each run's share of what the pair used, over their overlap (both running)."""
    starts = {r: min(c[1] for c in calls if c[0] == r) for r in section.runs}
    ends = {r: max(c[1] for c in calls if c[0] == r) for r in section.runs}
    lo, hi = max(starts.values()), min(ends.values())
    inside = [c for c in calls if lo <= c[1] <= hi]
    cap = section.limit_changes[0][1]["itpm"] * (hi - lo) / 60
    for r in section.runs:
        got = sum(c[3] for c in inside if c[0] == r) / cap
        verdict(f"shared: run {r}'s share of the itpm limit over the overlap ({hi - lo:.0f} s)",
                f"{got:.0%} (target 40-60%)", 0.4 <= got <= 0.6)


def plot(section: Section, bins: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = [(b + 0.5) * BIN_S / 60 for b in range(len(bins))]
    ax.step(xs, [max(b.values()) * 100 for b in bins], where="mid", label="limit used (% of the binding limit)")
    ax.axhline(100, color="grey", lw=0.6, ls="--")
    ax.set_xlabel("minutes from the run's start")
    ax.set_ylabel("% of the limit")
    ax.set_ylim(0, 150)
    ax2 = ax.twinx()
    ax2.plot([(t - section.start) / 60 for t, _, _ in section.fleet], [a for _, a, _ in section.fleet], color="C1",
             label="tasks running")
    ax2.plot([(t - section.start) / 60 for t, _, _ in section.fleet], [g for _, _, g in section.fleet], color="C2",
             ls=":", label="planner target")
    ax2.set_ylabel("tasks")
    fig.legend(loc="upper right", fontsize=8)
    ax.set_title(f"throughput benchmark, section {section.name}")
    fig.tight_layout()
    fig.savefig(path)


def start_ray(tries: int = 3) -> None:
    """The driver's Ray (dispatcher.driver.loop.ray_init), tried again: on a loaded machine its node can time out
    while starting."""
    import ray

    from dispatcher.backends import daemons
    from dispatcher.driver import loop as runmod

    for i in range(tries):
        try:
            return runmod.ray_init(False, daemons.aws_env())
        except Exception:  # Ray raises a bare Exception for a node that did not start
            ray.shutdown()
            if i == tries - 1:
                raise
            print("  Ray did not start (the machine is loaded?); trying again", file=sys.stderr, flush=True)


def run(sections: list[str], n: int, concurrency: int = 200, limits: dict[str, int] | None = None,
        plot_to: Path | None = None) -> dict[str, dict]:
    """Every section asked for, one after the other, in one database, against one simulator: their figures."""
    limits = limits or LIMITS
    tmp = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    os.environ["EVALPLANE_STATE_DIR"] = str(tmp / "state")
    dbname, motos = make_database(), start_aws()
    out: dict[str, dict] = {}
    try:
        import ray

        from contract import valkey_auth
        from simulator import SimulatorConfig
        from simulator.testing import simulator_process

        valkey_url = valkey_auth.default_url()
        start_ray()
        config = SimulatorConfig(api_key=KEY, policy="trajectory", seed=37, ttft_ms=200, tokens_per_s=600,
                                 rpm=limits["rpm"], itpm=limits["itpm"], otpm=OTPM, tpm=0)
        with simulator_process(config) as url, psycopg.connect(os.environ["DATABASE_URL"]) as conn:
            provider = Provider(url, limits)
            print(f"throughput benchmark: {n} attempts a run, sections {' '.join(sections)}; provider limits {limits}"
                  f" (otpm {OTPM:,}); backend.concurrency {concurrency}; {os.cpu_count()} cores, load average"
                  f" {os.getloadavg()[0]:.1f}. Real minutes (no time compression); short trajectories.", flush=True)
            for name in sections:
                if name == "spec":
                    s = run_section(name, tmp, n, provider, valkey_url, concurrency)
                    figures = report(s, conn, 1.15)
                elif name == "discovered":
                    s = run_section(name, tmp, n, provider, valkey_url, concurrency, known=False)
                    figures = report(s, conn, 1.25)
                elif name == "halved":
                    half = {d: v // 2 for d, v in limits.items()}
                    s = run_section(name, tmp, n, provider, valkey_url, concurrency,
                                    schedule=[(90.0, half), (210.0, dict(limits))])
                    figures = report(s, conn, None)
                    followed(s, figures["calls"])
                else:
                    s = run_section(name, tmp, 2 * n, provider, valkey_url, concurrency, shared=2)
                    figures = report(s, conn, 1.2)
                    shares(s, figures["calls"])
                out[name] = figures | {"section": s}
            if plot_to and out:
                first = out.get("spec") or next(iter(out.values()))
                plot(first["section"], first["bins"], plot_to)
                print(f"plot: {plot_to}")
        ray.shutdown()
        return out
    finally:
        for m in motos:
            m.terminate()
        with psycopg.connect(BASE_DB, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attempts", type=int, default=48, help="attempts of a run (a shared section: of both)")
    ap.add_argument("--full", action="store_true", help="240 attempts a run, every section")
    ap.add_argument("--sections", nargs="*", default=None, choices=["spec", "discovered", "halved", "shared"])
    ap.add_argument("--concurrency", type=int, default=200, help="backend.concurrency: the most tasks at once")
    ap.add_argument("--plot", type=Path, help="an SVG of the first section's run")
    args = ap.parse_args(argv)
    # the discovered section first: the spec section forecasts from its ledger
    sections = args.sections or (["discovered", "spec", "halved", "shared"] if args.full else ["discovered", "spec"])
    run(sections, 240 if args.full else args.attempts, args.concurrency, plot_to=args.plot)
    missed = [name for name, _, ok in RESULTS if not ok]
    print(f"{len(RESULTS) - len(missed)} of {len(RESULTS)} targets met" + (f"; missed: {missed}" if missed else ""))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
