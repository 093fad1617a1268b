"""The run's official results: a table, SWE-bench predictions.jsonl and the official run report JSON.

PostgreSQL is the source of truth; per-instance report.json files are rebuilt from the rows and the
eval logs are fetched from the run's S3 prefix, so the official `make_run_report` can be called as is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import psycopg
from rich.console import Console
from rich.table import Table

from contract import aws
from dispatcher.report.figures import ATTEMPT_COMPUTE, compute_usd, cost_figures, resources_text, usd_of
from dispatcher.report.reconcile import Reconciliation
from eval_worker.report import count_infra_failures

STATUS_ORDER = ("RESOLVED", "UNRESOLVED", "EMPTY_PATCH", "EVAL_ERROR", "INFRA_ERROR", "CANCELLED", "PATCH_READY")


def fetch_attempts(conn: psycopg.Connection, run: str) -> list[dict]:
    """Every attempt of the run with its latest verdict, its slot and whether a retry superseded it."""
    cur = conn.execute(
        f"""SELECT instance_id, attempt, v.slot, v.superseded, model, outcome, v.status, patch_uri, patch_bytes, calls,
                  input_tokens, cached_tokens, cache_write_tokens, output_tokens, cost_usd, wall_time_s,
                  v.eval_outcome, v.report, error, tamper_flags, {", ".join(ATTEMPT_COMPUTE)},
                  (SELECT count(*) FROM calls c WHERE c.run = a.run AND c.instance_id = a.instance_id
                     AND c.attempt = a.attempt) AS ledger_rows
           FROM attempts a JOIN attempt_verdicts v USING (run, instance_id, attempt)
           WHERE run = %s ORDER BY instance_id, v.slot, attempt""",
        (run,),
    )
    cols = [d.name for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    conn.commit()
    for r in rows:  # priced here once: the table, its footer and its cost lines read the same figure
        r["compute_usd"] = compute_usd(r)
    return rows


def results_table(run: str, attempts: list[dict], meters: Reconciliation | None = None) -> Table:
    """One row per attempt: tokens cost (the ledger's), compute cost (its recorded task and grading figures x the
    compute price table) and their total; the caption gives the three per attempt, instance and resolved instance,
    and, for a run through the gateway, whether its meters agree."""
    tokens = sum((usd_of(float(a["cost_usd"])) for a in attempts), start=usd_of(0))
    compute = sum((a["compute_usd"] for a in attempts), start=usd_of(0))
    resources = sorted({resources_text(a.get("task_cpu"), a.get("task_memory_mib"), a.get("task_memory_limit_mib"))
                        for a in attempts})
    caption = _cost_caption(attempts, tokens, compute)
    if meters is not None and meters.through_gateway:
        caption += "\n" + meters.caption()
    t = Table(title=f"run {run} (task resources: {'; '.join(resources)})", show_footer=True, caption=caption)
    t.add_column("instance", footer="total", no_wrap=True)
    t.add_column("att", justify="right")
    t.add_column("harness outcome")
    t.add_column("status", footer=_status_footer(attempts))
    t.add_column("calls", justify="right", footer=str(sum(a["calls"] for a in attempts)))
    t.add_column("tokens in/cached/out", justify="right", footer="/".join(
        str(sum(a[k] for a in attempts)) for k in ("input_tokens", "cached_tokens", "output_tokens")))
    t.add_column("tokens $", justify="right", footer=f"{tokens:.6f}")
    t.add_column("wall s", justify="right")
    t.add_column("task wall/cpu s", justify="right")
    t.add_column("peak MiB", justify="right")
    t.add_column("grading s", justify="right")
    t.add_column("compute $", justify="right", footer=f"{compute:.6f}")
    t.add_column("total $", justify="right", footer=f"{tokens + compute:.6f}")
    flagged = sum(1 for a in attempts if a.get("tamper_flags"))
    t.add_column("tamper flags", footer=f"{flagged} flagged" if flagged else "")
    for a in attempts:
        cost = usd_of(float(a["cost_usd"]))
        att = str(a["attempt"]) if a["slot"] == a["attempt"] else f"{a['attempt']} (slot {a['slot']})"
        status = f"{a['status']} (superseded)" if a["superseded"] else a["status"]
        t.add_row(a["instance_id"], att, a["outcome"], status, str(a["calls"]), f"{a['input_tokens']}/{a['cached_tokens']}/{a['output_tokens']}", f"{cost:.6f}",
                  f"{a['wall_time_s'] or 0:.1f}", f"{_secs(a.get('task_wall_s'))}/{_secs(a.get('task_cpu_s'))}",
                  _mib(a.get("task_memory_peak_bytes")), _secs(a.get("grading_wall_s")),
                  f"{a['compute_usd']:.6f}", f"{cost + a['compute_usd']:.6f}", tamper_text(a.get("tamper_flags")))
    return t


def _secs(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def _mib(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:.0f}"


def _cost_caption(attempts: list[dict], tokens, compute) -> str:
    instances = {a["instance_id"] for a in attempts}
    resolved = {a["instance_id"] for a in attempts if a["status"] == "RESOLVED"}
    c = cost_figures(tokens, compute, len(attempts), len(instances), len(resolved))

    def line(label: str, key: str) -> str:
        vals = [getattr(x, key) for x in (c, c.compute, c.combined)]
        return f"{label} " + " / ".join("–" if v is None else f"${v:.6f}" for v in vals)

    return ("tokens / compute / total: " + "; ".join([line("per attempt", "per_attempt_usd"),
                                                      line("per instance", "per_instance_usd"),
                                                      line("per resolved instance", "per_resolved_instance_usd")])
            + f"\ncompute priced at {c.compute_prices}")


def tamper_text(flags: list[dict] | None) -> str:
    """`conftest: tests/conftest.py; test_file: ...` (eval_worker.tamper's rules and the files each named)."""
    return "; ".join(f"{f['rule']}: {', '.join(f['files'])}" for f in flags or [])


def add_extra_keys(report_file: Path, attempts: list[dict], meters: Reconciliation | None) -> None:
    """The official report with our extra keys: tamper_flags ({instance_id: [{"rule", "files"}]} for the flagged
    attempts) and, for a run through the gateway, meters (Reconciliation.summary: do the meters agree); every
    official key stays as make_run_report wrote it."""
    report = json.loads(report_file.read_text())
    report["tamper_flags"] = {a["instance_id"]: a["tamper_flags"] for a in attempts if a.get("tamper_flags")}
    if meters is not None and meters.through_gateway:
        report["meters"] = meters.summary()
    report_file.write_text(json.dumps(report, indent=4))


def _status_footer(attempts: list[dict]) -> str:
    """The counted attempts' statuses, and how many retries superseded."""
    counts = {s: sum(1 for a in attempts if a["status"] == s and not a["superseded"]) for s in STATUS_ORDER}
    counts["SUPERSEDED"] = sum(1 for a in attempts if a["superseded"])
    return " ".join(f"{s.lower()}={n}" for s, n in counts.items() if n)


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def official_run_id(run: str, attempt: int, attempts: int) -> str:
    return run if attempts == 1 else f"{run}.attempt-{attempt}"


def write_outputs(run: str, attempts: list[dict], dataset: list[dict], out_dir: Path, n_attempts: int,
                  artifacts_prefix, meters: Reconciliation | None = None) -> list[Path]:
    """predictions.jsonl + <model>.<run_id>.json per attempt number, in the official formats."""
    from swebench.harness.constants import LOG_REPORT, RUN_EVALUATION_LOG_DIR
    from swebench.harness.reporting import make_run_report

    written = []
    for n in range(1, n_attempts + 1):  # per slot, its latest attempt (a retry's, once landed)
        mine = [a for a in attempts if a["slot"] == n and not a["superseded"]]
        run_id = official_run_id(run, n, n_attempts)
        base = out_dir if n_attempts == 1 else out_dir / f"attempt-{n}"
        base.mkdir(parents=True, exist_ok=True)
        preds = {}
        for a in mine:
            patch = aws.get_text(a["patch_uri"]) if a["patch_uri"] and a["patch_bytes"] else ""
            preds[a["instance_id"]] = {"instance_id": a["instance_id"], "model_name_or_path": a["model"],
                                       "model_patch": patch}
            if a["report"] is not None:
                inst_dir = base / RUN_EVALUATION_LOG_DIR / run_id / a["model"].replace("/", "__") / a["instance_id"]
                inst_dir.mkdir(parents=True, exist_ok=True)
                _fetch_eval_logs(artifacts_prefix(a["instance_id"], a["attempt"]), inst_dir)
                (inst_dir / LOG_REPORT).write_text(json.dumps({a["instance_id"]: a["report"]}, indent=4))
        pred_file = base / "predictions.jsonl"
        pred_file.write_text("".join(json.dumps(p) + "\n" for p in preds.values()))
        selected = [r for r in dataset if r["instance_id"] in preds]
        with _cwd(base), contextlib.redirect_stdout(open(os.devnull, "w")):
            report = make_run_report(preds, selected, run_id, client=None, report_dir=".")
        mark_infra_failures(base / report, {a["instance_id"]: infra_reason(a) for a in mine
                                            if a["status"] == "INFRA_ERROR"})
        add_extra_keys(base / report, mine, meters)
        written += [pred_file, base / report]
    return written


def infra_reason(attempt: dict) -> str:
    """Why an attempt is an infrastructure failure: the grading environment's reason, else the task's."""
    reason = (attempt.get("report") or {}).get("infra_failure_reason")
    if reason:
        return reason
    head = (attempt.get("error") or "infra_error").split(":", 1)[0]  # "rate_limited: ..." -> rate_limited
    return re.sub(r"\W+", "_", head.strip().lower()).strip("_")[:60]


def mark_infra_failures(report_file: Path, infra: dict[str, str]) -> None:
    """The official report, with our infrastructure failures where they belong: make_run_report knows only what
    its log patterns catch, so an attempt whose task or grading environment failed would read as an empty patch or
    unresolved (eval_worker.report.count_infra_failures)."""
    if infra:
        report = count_infra_failures(json.loads(report_file.read_text()), infra)
        report_file.write_text(json.dumps(report, indent=4))


def _fetch_eval_logs(prefix: str, dest: Path) -> None:
    """Copy the eval worker's log files (test_output.txt, run_instance.log, ...) next to the report."""
    bucket, key = aws.split_s3_uri(aws.eval_logs_prefix(prefix))
    s3 = aws.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        for obj in page.get("Contents", []):
            name = obj["Key"].rsplit("/", 1)[-1]
            if name and name != "report.json":
                (dest / name).write_bytes(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())


def print_results(console: Console, run: str, attempts: list[dict], files: list[Path],
                  meters: Reconciliation | None = None) -> None:
    console.print(results_table(run, attempts, meters))
    for f in files:
        console.print(f"wrote {f}")
