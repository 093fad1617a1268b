"""`python -m dispatcher {run,validate,report,status} ...`"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rich.console import Console

from contract import db
from dispatcher import localstack
from dispatcher.plan import Plan, make_plan
from dispatcher.spec import SpecError, load_spec

EXIT_SPEC = 2
EXIT_CONFLICT = 3


def _plan(spec_file: str, err: Console) -> Plan | None:
    try:
        spec = load_spec(spec_file)
        return make_plan(spec, spec_file)
    except SpecError as e:
        err.print(f"[bold red]{len(e.problems)} problem(s) in {e.file}:[/]")
        for p in e.problems:
            err.print(f"  {p}", markup=False, highlight=False, soft_wrap=True)
        return None


def _valkey_url() -> str:
    return os.environ.get("VALKEY_URL", "redis://127.0.0.1:6379/0")


def cmd_validate(args, out: Console, err: Console) -> int:
    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    out.print(f"{args.spec}: ok: run {plan.spec.run.name!r}, {len(plan.rows)} instance(s), "
              f"{len(plan.refs)} attempt(s), pool {plan.spec.pool!r}, backend {plan.spec.backend.kind}")
    return 0


def cmd_run(args, out: Console, err: Console) -> int:
    from dispatcher.run import RunConflict, execute

    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    try:
        state = execute(plan, _valkey_url(), err)
    except RunConflict as e:
        err.print(f"[bold red]error:[/] {e}")
        return EXIT_CONFLICT
    if state == "finished":
        err.print(f"run {plan.spec.run.name!r} is finished")
    return _report(plan, args.out, out)


def _report(plan: Plan, out_dir: str | None, out: Console) -> int:
    from dispatcher import report, resources

    run = plan.spec.run.name
    localstack.ensure_moto()
    with db.connect() as conn:
        attempts = report.fetch_attempts(conn, run)
    res_prefix = f"s3://{resources.DEFAULT_BUCKET}/runs/{run}/attempts/"
    dest = Path(out_dir) if out_dir else localstack.state_dir() / "runs" / run / "results"
    files = report.write_outputs(run, attempts, list(plan.rows.values()), dest, plan.spec.run.attempts,
                                 lambda iid, n: f"{res_prefix}{iid}/{n}/")
    report.print_results(out, run, attempts, files)
    return 0


def cmd_report(args, out: Console, err: Console) -> int:
    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    with db.connect() as conn:
        db.migrate(conn)
        if conn.execute("SELECT 1 FROM runs WHERE run = %s", (plan.spec.run.name,)).fetchone() is None:
            err.print(f"[bold red]error:[/] no run named {plan.spec.run.name!r}")
            return 1
    return _report(plan, args.out, out)


def cmd_status(args, out: Console, err: Console) -> int:
    with db.connect() as conn:
        db.migrate(conn)
        runs = conn.execute(
            """SELECT r.run, r.status, r.attempts, count(a.*), count(a.*) FILTER (WHERE a.status = 'RESOLVED'),
                      coalesce(sum(a.cost_usd), 0), r.created_at
               FROM runs r LEFT JOIN attempts a USING (run)
               WHERE %s::text IS NULL OR r.run = %s GROUP BY r.run ORDER BY r.created_at""",
            (args.run, args.run),
        ).fetchall()
    for run, status, planned, landed, resolved, cost, created in runs:
        out.print(f"{run}: {status}, {landed}/{planned} attempts landed, {resolved} resolved, ${float(cost):.6f}, "
                  f"created {created:%Y-%m-%d %H:%M}")
    if args.run and not runs:
        err.print(f"no run named {args.run!r}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run (or resume) the evaluation a spec describes; prints the results table")
    p.add_argument("spec")
    p.add_argument("--out", help="folder for predictions.jsonl and the report JSON")
    p = sub.add_parser("validate", help="check a spec without running anything")
    p.add_argument("spec")
    p = sub.add_parser("report", help="print the results of a spec's run and write its outputs again")
    p.add_argument("spec")
    p.add_argument("--out")
    p = sub.add_parser("status", help="list runs and their progress")
    p.add_argument("run", nargs="?")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The results table wants ~150 columns: use them when stdout is not a terminal (logs, CI, pipes).
    out = Console() if sys.stdout.isatty() else Console(width=160)
    err = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)
    return {"run": cmd_run, "validate": cmd_validate, "report": cmd_report, "status": cmd_status}[args.cmd](args, out, err)


if __name__ == "__main__":
    sys.exit(main())
