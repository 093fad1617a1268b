"""`python -m dispatcher report RUN [--compare RUN_B]`: a run's figures (or two runs' and their paired comparison)
as summary.json, PNG plots and one self-contained report.html, plus a summary in the terminal."""

from __future__ import annotations

from pathlib import Path

import psycopg
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from dispatcher.report import figures, html, plots
from dispatcher.report.figures import RunFigures
from dispatcher.report.stats import PairedDifference, paired_difference


class Report(BaseModel):
    runs: list[RunFigures]
    compare: PairedDifference | None = None


class ReportFiles(BaseModel):
    summary: Path
    html: Path
    pngs: list[Path]


def build(conn: psycopg.Connection, run: str, out: Path, compare: str | None = None) -> tuple[Report, ReportFiles]:
    """Raises figures.NoSuchRun for an unknown run (before anything is written)."""
    loaded = [figures.load(conn, run)] + ([figures.load(conn, compare)] if compare else [])
    runs = [f for f, _ in loaded]
    diff = None
    if compare:
        a, b = runs
        diff = paired_difference(a.outcomes(), b.outcomes(), a.first_scored(), b.first_scored())
    out.mkdir(parents=True, exist_ok=True)
    pngs = [plots.resolved_vs_cost(loaded, out / "resolved_vs_cost.png"),
            plots.spend_over_time(loaded, out / "spend_over_time.png"),
            plots.concurrency_over_time(loaded, out / "concurrency_over_time.png")]
    if compare:
        pngs.append(plots.instance_grid(runs[0], runs[1], out / "instance_grid.png"))
    report = Report(runs=runs, compare=diff)
    summary = out / "summary.json"
    summary.write_text(report.model_dump_json(indent=2))
    page = html.render(runs, diff, pngs, out / "report.html")
    return report, ReportFiles(summary=summary, html=page, pngs=pngs)


def print_summary(console: Console, report: Report, files: ReportFiles) -> None:
    t = Table(title="report" if report.compare is None else "comparison")
    t.add_column("")
    for f in report.runs:
        t.add_column(f.run, justify="right")

    def row(label, fn):
        t.add_row(label, *(fn(f) for f in report.runs))

    row("attempts landed / planned", lambda f: f"{f.landed} / {f.planned}")
    row("statuses", lambda f: " ".join(f"{s.lower()}={n}" for s, n in sorted(f.statuses.items())))
    row("resolved instances", lambda f: f"{f.resolved_instances} / {f.instances}")
    row("tamper-flagged attempts", lambda f: str(sum(1 for a in f.attempts if a.tamper_flags)))
    for k in sorted({p.k for f in report.runs for p in f.pass_at}):
        row(f"pass@{k} [95% CI]", lambda f, k=k: next(
            (f"{p.estimate.value:.3f} [{p.estimate.lo:.3f}, {p.estimate.hi:.3f}]" for p in f.pass_at if p.k == k),
            "–"))
    row("task resources", lambda f: "; ".join(f.resources))
    row("tokens cost (ledger)", lambda f: html.usd(f.cost.total_usd))
    row("compute cost (tasks, grading)", lambda f: html.usd(f.cost.compute.total_usd))
    row("total cost", lambda f: html.usd(f.cost.combined.total_usd))
    for label, key in (("attempt", "per_attempt_usd"), ("instance", "per_instance_usd"),
                       ("resolved instance", "per_resolved_instance_usd")):
        row(f"per {label}: tokens / compute / total", lambda f, key=key: " / ".join(
            html.usd(getattr(x, key)) for x in (f.cost, f.cost.compute, f.cost.combined)))
    row("task cpu s / wall s (summed)", lambda f: f"{html.secs(f.time.task_cpu_s)} / {html.secs(f.time.task_wall_s)}")
    row("tokens in/cached/out", lambda f: f"{f.tokens.input_tokens}/{f.tokens.cached_tokens}/{f.tokens.output_tokens}")
    row("cache-hit rate", lambda f: html.pct(f.tokens.cache_hit_rate))
    row("calls (retries)", lambda f: f"{f.calls.calls} ({f.calls.retries})")
    row("latency p50/p90/p99", lambda f: f"{html.ms(f.calls.latency_ms_p50)} / {html.ms(f.calls.latency_ms_p90)} / "
                                          f"{html.ms(f.calls.latency_ms_p99)}")
    row("pacer-wait share", lambda f: html.pct(f.calls.pacer_wait_share))
    console.print(t)
    if report.compare is not None:
        c = report.compare
        console.print(f"paired difference on {c.instances} shared instance(s): {html.signed_pct(c.difference.value)}"
                      f" [{html.signed_pct(c.difference.lo)}, {html.signed_pct(c.difference.hi)}];"
                      f" McNemar (first scored attempt): {c.mcnemar.a_only} vs {c.mcnemar.b_only} discordant,"
                      f" p = {c.mcnemar.p_value:.4g}", highlight=False, soft_wrap=True)
    for p in (files.summary, files.html, *files.pngs):
        console.print(f"wrote {p}", highlight=False, soft_wrap=True)
