"""`python -m dispatcher {validate,plan,images,run,resume,cancel,report,status,dashboard,judge} ...`"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from contract import db, task_shape
from contract.models import AttemptRef
from dispatcher.backends import daemons
from dispatcher.launchers.process import agent_isolation_problem
from dispatcher.plan import Plan, apply_validation, make_plan
from dispatcher.spec import SpecError, load_spec

EXIT_SPEC = 2
EXIT_CONFLICT = 3
DASHBOARD_PORT = 8270  # dispatcher.dashboard.app.DEFAULT_PORT (not imported: aiohttp is not needed by every command)


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
    """VALKEY_URL, else the project's own Valkey's admin URL (scripts/stack.sh up)."""
    from contract.valkey_auth import default_url

    return default_url()


def _print_problems(err: Console, what: str, problems: dict[str, str]) -> None:
    err.print(f"[bold red]{len(problems)} instance(s) without {what}:[/]")
    for iid, why in sorted(problems.items()):
        err.print(f"  {iid}: {why}", markup=False, highlight=False, soft_wrap=True)


def image_problems(plan: Plan) -> dict[str, str]:
    """What each instance lacks to run in its task image, without building anything: on AWS, its task image
    recorded in the estate's registry; locally, its instance image (or a bundle to analytics a stand-in from)."""
    if not plan.in_task_images:
        return {}
    from dispatcher import images

    if plan.spec.backend.kind == "aws":
        with db.connect() as conn:
            db.migrate(conn)
            return images.for_plan(plan, conn, build=False)[1]
    import docker

    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as e:  # noqa: BLE001 - no engine at all
        return {iid: f"backend.launcher = 'docker' but no Docker engine answers ({e}); scripts/docker.sh up"
                for iid in plan.rows}
    problems = {}
    t = images.target(plan.spec)
    for iid, row in plan.rows.items():
        try:
            from eval_worker.pinning import ImageResolver, ImageUnavailable

            ImageResolver(db.database_url(), t.instance_registry).resolve(client, row)
        except ImageUnavailable as e:
            if iid not in plan.bundles or t.instance_registry:
                problems[iid] = f"no image: {e}"
    return problems


def cmd_validate(args, out: Console, err: Console) -> int:
    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    if problem := agent_isolation_problem(plan.spec):
        err.print(f"[bold red]refused:[/] {problem}", soft_wrap=True)
        return EXIT_SPEC
    missing = image_problems(plan)
    if missing:
        _print_problems(err, "what their task image needs", missing)
        return EXIT_SPEC
    out.print(f"{args.spec}: ok: run {plan.spec.run.name!r}, {len(plan.rows)} instance(s), "
              f"{len(plan.refs)} attempt(s), pool {plan.spec.pool!r}, backend {plan.spec.backend.kind}"
              + (f", launcher {plan.spec.backend.launcher}" if plan.spec.backend.kind == "local" else ""))
    return 0


def cmd_images(args, out: Console, err: Console) -> int:
    """Build (or reuse) the task image of every instance the spec names, push, record; print what it did."""
    from rich.table import Table

    from dispatcher import images

    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    logging.getLogger("evalplane.images").setLevel(logging.INFO)
    t0 = time.monotonic()
    with db.connect() as conn:
        db.migrate(conn)
        built, problems = images.for_plan(plan, conn, build=True, force=args.force,
                                          on_image=lambda t: err.print(
                                              f"{t.instance_id}: {'built' if t.built else 'reused'} {t.ref}",
                                              markup=False, highlight=False, soft_wrap=True))
    table = Table(title=f"task images for {plan.spec.run.name} ({plan.spec.harness.name})")
    for col in ("instance", "image (by digest)", "", "analytics s", "layers MB", "image MB"):
        table.add_column(col, justify="right" if col.endswith(("s", "MB")) else "left")
    for iid, t in sorted(built.items()):
        table.add_row(iid, t.ref, "built" if t.built else "reused", f"{t.build_s:.1f}" if t.built else "-",
                      f"{t.layer_bytes / 1e6:.1f}", f"{t.size_bytes / 1e6:.0f}")
    out.print(table)
    n_built = sum(t.built for t in built.values())
    out.print(f"{n_built} built, {len(built) - n_built} reused, {len(problems)} missing, {time.monotonic() - t0:.1f} s")
    if problems:
        _print_problems(err, "a task image", problems)
        return 1
    return 0


def cmd_run(args, out: Console, err: Console) -> int:
    from dispatcher.driver.loop import RunConflict, execute

    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    try:
        with db.connect() as conn:
            db.migrate(conn)
            plan, warnings = apply_validation(plan, conn, args.spec)
    except SpecError as e:
        err.print(f"[bold red]refused:[/] {e}", soft_wrap=True)
        return EXIT_SPEC
    for w in warnings:
        err.print(f"[yellow]warning:[/] {w}", soft_wrap=True)
    if problem := agent_isolation_problem(plan.spec):
        err.print(f"[bold red]refused:[/] {problem}", soft_wrap=True)
        return EXIT_SPEC
    if plan.in_task_images:
        from dispatcher import images

        with db.connect() as conn:  # locally, analytics what is missing (reusing the rest); on AWS, the analytics tier's
            found, problems = images.for_plan(plan, conn, build=plan.spec.backend.kind == "local")
        if problems:
            _print_problems(err, "a task image", problems)
            return EXIT_SPEC
        plan.task_images = {iid: t.ref for iid, t in found.items()}
    try:
        state = execute(plan, _valkey_url(), err)
    except RunConflict as e:
        err.print(f"[bold red]error:[/] {e}")
        return EXIT_CONFLICT
    if state == "finished":
        err.print(f"run {plan.spec.run.name!r} is finished")
    return _report(plan, args.out, out)


def _report(plan: Plan, out_dir: str | None, out: Console) -> int:
    from dispatcher import report
    from dispatcher.backends import resources

    run = plan.spec.run.name
    with db.connect() as conn:
        attempts = report.fetch_attempts(conn, run)
    bucket = resources.DEFAULT_BUCKET
    if plan.spec.backend.kind == "aws":
        from dispatcher.backends.stack_outputs import StackOutputs

        bucket = StackOutputs.load(plan.spec.backend.stack_outputs).bucket
    else:
        daemons.ensure_moto()
    dest = Path(out_dir) if out_dir else daemons.state_dir() / "runs" / run / "results"
    files = report.write_outputs(run, attempts, list(plan.rows.values()), dest, plan.spec.run.attempts,
                                 lambda iid, n: resources.artifacts_prefix(
                                     bucket, AttemptRef(run=run, instance_id=iid, attempt=n)))
    report.print_results(out, run, attempts, files)
    return 0


def cmd_report(args, out: Console, err: Console) -> int:
    """A spec file: its run's official outputs again, then the report. A run name: the report (and the official
    outputs too where the run's stored spec still loads). --compare: the two runs side by side, paired."""
    from dispatcher.report import analytics
    from dispatcher.report.figures import NoSuchRun
    from dispatcher.spec import RUN_NAME

    is_spec = Path(args.target).is_file()
    if not is_spec and not RUN_NAME.match(args.target):
        err.print(f"[bold red]error:[/] {args.target!r} is neither a spec file nor a run name")
        return EXIT_SPEC
    plan = _plan(args.target, err) if is_spec else None
    if is_spec and plan is None:
        return EXIT_SPEC
    run = plan.spec.run.name if plan else args.target
    with db.connect() as conn:
        db.migrate(conn)
        for name in filter(None, (run, args.compare)):
            if conn.execute("SELECT 1 FROM runs WHERE run = %s", (name,)).fetchone() is None:
                err.print(f"[bold red]error:[/] no run named {name!r}")
                return 1
        if plan is None:
            plan = _stored_plan(conn, run, err)
    if plan is not None and not args.compare:
        _report(plan, args.out, out)
    dest = Path(args.out) / "report" if args.out else daemons.state_dir() / (
        f"reports/{run}-vs-{args.compare}" if args.compare else f"runs/{run}/report")
    with db.connect() as conn:
        try:
            report, files = analytics.build(conn, run, dest, args.compare)
        except (NoSuchRun, ValueError) as e:
            err.print(f"[bold red]error:[/] {e}")
            return 1
    analytics.print_summary(out, report, files)
    return 0


def _stored_plan(conn, run: str, err: Console) -> Plan | None:
    """The plan of a run from the spec its row stores (paths in it are absolute), or None if that no longer loads
    (a dataset moved): the official outputs need the dataset's rows, the report does not."""
    from pydantic import ValidationError

    from dispatcher.spec import Spec

    spec = conn.execute("SELECT spec FROM runs WHERE run = %s", (run,)).fetchone()[0]
    try:
        return make_plan(Spec.model_validate(spec, context={"base_dir": "/"}))
    except (ValidationError, SpecError) as e:
        err.print(f"[yellow]warning:[/] run {run!r}: its stored spec no longer loads, so the official outputs are "
                  f"not rewritten (`report SPEC` does): {str(e).splitlines()[0]}", soft_wrap=True)
        return None


def cmd_judge(args, out: Console, err: Console) -> int:
    """Judge every attempt of a run without a verdict for the rubric: here, or in an ECS task for a run on AWS."""
    import secrets

    from pydantic import ValidationError

    from dispatcher.judge import rubric as rubrics
    from dispatcher.judge.runner import JudgePass, JudgeSettings

    try:
        rubric = rubrics.load(_local_copy(args.rubric)) if args.rubric else rubrics.DEFAULT
    except rubrics.RubricError as e:
        err.print(f"rubric: {e}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_SPEC
    with db.connect() as conn:
        db.migrate(conn)
        row = conn.execute("SELECT backend, spec FROM runs WHERE run = %s", (args.run,)).fetchone()
    if row is None:
        err.print(f"[bold red]error:[/] no run named {args.run!r}")
        return 1
    backend, spec = row
    try:  # the flags first: a bad one is refused before anything starts
        settings = JudgeSettings(provider=args.provider, model=args.model, upstream_url=args.base_url or "unset",
                                 budget_usd=args.budget_usd, attempt_usd=args.attempt_usd,
                                 max_tokens=args.max_tokens, concurrency=args.concurrency, valkey_url=_valkey_url())
    except ValidationError as e:
        for problem in e.errors():
            err.print(f"--{str(problem['loc'][0]).replace('_', '-')}: {problem['msg']}", highlight=False)
        return EXIT_SPEC
    if backend == "aws" and not args.here:
        from dispatcher.judge.ecs import launch
        from dispatcher.backends.stack_outputs import StackOutputsError

        try:
            arn = launch(spec["backend"]["stack_outputs"], args.run, judge_argv(args), rubric if args.rubric else None)
        except (StackOutputsError, RuntimeError) as e:
            err.print(f"[bold red]error:[/] {e}", soft_wrap=True)
            return 1
        out.print(f"judge task started for run {args.run!r}: {arn}")
        return 0
    services = None
    if args.base_url:
        upstream, key = args.base_url, os.environ.get(args.api_key_env, "")
        if not key:
            err.print(f"[bold red]error:[/] --api-key-env: environment variable {args.api_key_env} is not set")
            return EXIT_SPEC
    elif backend == "local":
        from dispatcher.backends.local_services import LocalServices

        daemons.ensure_moto()
        services = LocalServices(daemons.state_dir() / "runs" / args.run / "judge")
        upstream, key = services.simulator(["--policy", "judge"], "sk-judge-" + secrets.token_hex(16))
    else:
        err.print("[bold red]error:[/] --base-url is required for a run on AWS")
        return EXIT_SPEC
    settings = settings.model_copy(update={"upstream_url": upstream})
    judge = JudgePass(args.run, rubric, settings, key, daemons.state_dir() / "judge", db.database_url())
    try:
        summary = judge.run_pass()
    finally:  # a killed pass leaves its simulator to the next one (LocalServices finds it); a finished one stops it
        if services is not None:
            services.stop_all()
    out.print(f"run {args.run}, rubric {rubric.name} ({rubric.sha}): {summary.judged} judged,"
              f" {summary.parse_failures} parse failure(s), {summary.no_trajectory} without a trajectory,"
              f" {summary.over_attempt_cap} over the per-trajectory cap, {summary.left} left for a rerun;"
              f" calls in the ledger under run {judge.judge_run!r}", highlight=False, soft_wrap=True)
    for problem in summary.problems[:20]:
        err.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
    return 1 if summary.left else 0


def judge_argv(args) -> list[str]:
    """The judge's own command line, for the ECS task that runs it (`--here`: in that task)."""
    argv = ["judge", args.run, "--here", "--provider", args.provider, "--model", args.model,
            "--api-key-env", args.api_key_env, "--budget-usd", str(args.budget_usd), "--max-tokens",
            str(args.max_tokens), "--concurrency", str(args.concurrency)]
    for flag, value in (("--rubric", args.rubric), ("--base-url", args.base_url), ("--attempt-usd", args.attempt_usd)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _local_copy(path: str) -> str:
    """A rubric given as s3://... (the ECS judge task's) is read from S3 into a temporary file."""
    if not path.startswith("s3://"):
        return path
    import tempfile

    from contract import aws

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(aws.get_text(path))
    return f.name


def cmd_dashboard(args, out: Console, err: Console) -> int:
    """Serve the live dashboard until interrupted (SIGINT/SIGTERM)."""
    import asyncio
    import signal

    from dispatcher.dashboard.app import serve

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await serve(_valkey_url(), args.host, args.port, Path(args.port_file) if args.port_file else None, stop)

    try:
        asyncio.run(main())
    except OSError as e:
        err.print(f"[bold red]error:[/] cannot serve on {args.host}:{args.port}: {e}")
        return 1
    return 0


def cmd_plan(args, out: Console, err: Console) -> int:
    """Predicted fleet size, wall time and cost, from the pool's limits and its ledger, before any launch."""
    import redis

    from contract import keys, pricing
    from dispatcher.driver.pacing import PacerPolicy
    from dispatcher.driver.fleet import observe, predict

    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    spec = plan.spec
    limits = {k: v for k, v in {"rpm": spec.model.rpm, "itpm": spec.model.itpm, "otpm": spec.model.otpm}.items() if v}
    source = "spec"
    try:
        r = redis.Redis.from_url(_valkey_url(), decode_responses=True)
        stored = r.hgetall(keys.pool_limits(spec.pool))
        discovered = PacerPolicy().discovered(r.hgetall(keys.pool_discovered(spec.pool)))
        if stored:
            limits, source = {k: int(v) for k, v in stored.items()}, "the pool's pacer"
        elif discovered:
            limits, source = limits | discovered, "provider headers the shims recorded"
    except redis.RedisError as e:
        err.print(f"warning: Valkey not reachable ({e}); using the spec's limits")
    with db.connect() as conn:
        db.migrate(conn)
        obs = observe(conn, spec.pool)
        done = conn.execute("SELECT count(*) FROM attempts WHERE run = %s", (spec.run.name,)).fetchone()[0]
    try:
        price = pricing.price(spec.model.model, spec.model.provider)
    except pricing.UnknownModel:
        price = None
    todo = len(plan.refs) - done
    aws = spec.backend.kind == "aws"  # locally nothing paces launches; the launchers report their rate as they run
    p = predict(max(todo, 0), limits, obs, price, spec.backend.concurrency, spec.budget.run_usd,
                spec.backend.launch_rate_per_s if aws else None, spec.backend.launch_burst)
    lim = ", ".join(f"{k} {v}" for k, v in limits.items()) or "none known (unpaced)"
    out.print(f"run {spec.run.name}: {len(plan.refs)} attempt(s) ({len(plan.rows)} instance(s) x {spec.run.attempts}),"
              f" {done} already landed, {todo} to run", soft_wrap=True)
    out.print(f"pool {spec.pool}: limits {lim} (from {source}); call shape from the {p.basis}", soft_wrap=True)
    out.print(f"  per attempt: {obs.calls_per_attempt:.1f} calls, {obs.attempt_minutes:.1f} min; per call:"
              f" {obs.input_per_call:.0f} input, {obs.cached_per_call:.0f} cached, {obs.output_per_call:.0f} output"
              f" tokens", soft_wrap=True)
    if todo <= 0:
        out.print("nothing left to run")
        return 0
    fed = "unbounded" if p.feedable == float("inf") else f"{p.feedable:.0f}"
    out.print(f"predicted fleet: {p.concurrency} concurrent task(s) (limits can feed {fed};"
              f" spec allows {spec.backend.concurrency})", soft_wrap=True)
    if aws:
        out.print(f"predicted launch time: {p.launch_s / 60:.1f} min to start {todo} task(s) at the ECS launch quota"
                  f" ({spec.backend.launch_rate_per_s:g} tasks/s after a burst of {spec.backend.launch_burst};"
                  f" backend.launch_rate_per_s, backend.launch_burst)", soft_wrap=True)
    out.print(f"predicted wall time: {p.wall_time_s / 60:.1f} min"
              + (" (launch time included)" if p.launch_s else ""), soft_wrap=True)
    cost = "unknown (model not in the price table)" if price is None else f"${p.cost_usd:.4f}" + (
        f" (capped by the run budget ${spec.budget.run_usd})" if p.capped_by_budget else "")
    out.print(f"predicted cost: {cost}", soft_wrap=True)
    if problem := agent_isolation_problem(plan.spec):
        err.print(f"[bold red]refused:[/] {problem}", soft_wrap=True)
        return EXIT_SPEC
    missing = image_problems(plan)
    if missing:
        _print_problems(err, "what their task image needs", missing)
        return EXIT_SPEC
    return 0


def cmd_resume(args, out: Console, err: Console) -> int:
    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    with db.connect() as conn:
        db.migrate(conn)
        row = conn.execute("SELECT status FROM runs WHERE run = %s", (plan.spec.run.name,)).fetchone()
    if row is None:
        err.print(f"[bold red]error:[/] no run named {plan.spec.run.name!r} to resume; use `run`")
        return 1
    return cmd_run(args, out, err)


def cmd_cancel(args, out: Console, err: Console) -> int:
    """Mark the run cancelled: its driver stops launching, stops running tasks, lands the rest as cancelled."""
    plan = _plan(args.spec, err)
    if plan is None:
        return EXIT_SPEC
    with db.connect() as conn:
        db.migrate(conn)
        cur = conn.execute("UPDATE runs SET status = 'cancelled' WHERE run = %s AND status = 'running'",
                           (plan.spec.run.name,))
    if cur.rowcount == 0:
        err.print(f"no running run named {plan.spec.run.name!r}")
        return 1
    out.print(f"run {plan.spec.run.name!r} cancelled; its driver lands the remaining attempts as cancelled"
              " (run `resume` if no driver is running)")
    return 0


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
    p = sub.add_parser("images", help="analytics (or reuse) each instance's task image, push it, record its digest")
    p.add_argument("spec")
    p.add_argument("--force", action="store_true", help="rebuild even where the inputs did not change")
    p = sub.add_parser("report", help="a run's report (figures, plots, HTML); with a spec, its official outputs too")
    p.add_argument("target", metavar="RUN|SPEC", help="a run name, or the spec file of a run")
    p.add_argument("--compare", metavar="RUN_B", help="compare with another run: paired, on their shared instances")
    p.add_argument("--out", help="folder for the outputs (the report goes to its report/ subfolder)")
    p = sub.add_parser("judge", help="a model judges each attempt's trajectory against a rubric (one verdict row each)")
    p.add_argument("run")
    p.add_argument("--rubric", help="a TOML rubric (or s3:// URI of one); default: solved, looked_outside, tampered_tests")
    p.add_argument("--provider", choices=("openai", "anthropic"), default="openai")
    p.add_argument("--model", default="gpt-4o-mini", help="the judge's model (priced from LiteLLM's table)")
    p.add_argument("--base-url", help="the gateway; unset with a local run: the provider simulator's judge policy")
    p.add_argument("--api-key-env", default=task_shape.JUDGE_KEY_ENV, help="env var with the judge's own provider key")
    p.add_argument("--budget-usd", type=float, default=1.0, help="the judge's own budget for the pass (default 1.0)")
    p.add_argument("--attempt-usd", type=float, help="a cap per judged trajectory")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--here", action="store_true", help="judge in this process even for a run on AWS (the ECS task's)")
    p = sub.add_parser("dashboard", help="serve the live dashboard (reads Valkey only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DASHBOARD_PORT, help=f"0 = any free port (default {DASHBOARD_PORT})")
    p.add_argument("--port-file", help="write the dashboard's URL here once it serves")
    p = sub.add_parser("plan", help="predict fleet size, wall time and cost before launching anything")
    p.add_argument("spec")
    p = sub.add_parser("resume", help="resume an unfinished run (after a crash or kill of its driver)")
    p.add_argument("spec")
    p.add_argument("--out")
    p = sub.add_parser("cancel", help="cancel a running run")
    p.add_argument("spec")
    p = sub.add_parser("status", help="list runs and their progress")
    p.add_argument("run", nargs="?")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The results table wants ~150 columns: use them when stdout is not a terminal (logs, CI, pipes).
    out = Console() if sys.stdout.isatty() else Console(width=160)
    err = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)
    commands = {"run": cmd_run, "validate": cmd_validate, "images": cmd_images, "report": cmd_report, "status": cmd_status,
                "plan": cmd_plan, "resume": cmd_resume, "cancel": cmd_cancel, "dashboard": cmd_dashboard,
                "judge": cmd_judge}
    return commands[args.cmd](args, out, err)


if __name__ == "__main__":
    sys.exit(main())
