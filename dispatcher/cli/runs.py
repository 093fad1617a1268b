"""A run's life: `run` and `resume` drive it, `cancel` stops it, `status` and `dashboard` watch it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dispatcher import backends, store
from dispatcher.cli import stack, target
from dispatcher.cli.errors import EXIT_CONFLICT, EXIT_SPEC, Refused
from dispatcher.cli.output import err, out, print_problems
from dispatcher.cli.results import write_outputs
from dispatcher.launchers.process import agent_isolation_problem
from dispatcher.plan import Plan, apply_validation
from dispatcher.spec import SpecError

DASHBOARD_PORT = 8270  # dispatcher.dashboard.app.DEFAULT_PORT (not imported: aiohttp is not needed by every command)
RUN_OR_SPEC = Annotated[str, typer.Argument(metavar="RUN_OR_SPEC", help=target.HELP, show_default=False)]
OUT = Annotated[str | None, typer.Option("--out", help="folder for predictions.jsonl and the report JSON")]


def _drive(plan: Plan, source: str, out_dir: str | None) -> None:
    """Run (or resume) the plan to its end, then print its results and write its official outputs."""
    from dispatcher.driver.loop import RunConflict, execute

    try:
        with store.connect() as conn:
            plan, warnings = apply_validation(plan, conn, source)
    except SpecError as e:
        err.print(f"[bold red]refused:[/] {e}", soft_wrap=True)
        raise typer.Exit(EXIT_SPEC) from None
    for w in warnings:
        err.print(f"[yellow]warning:[/] {w}", soft_wrap=True)
    if problem := agent_isolation_problem(plan.spec):
        err.print(f"[bold red]refused:[/] {problem}", soft_wrap=True)
        raise typer.Exit(EXIT_SPEC)
    # Locally the driver's Valkey must answer before anything is built or launched; on AWS it is the estate's.
    backend = backends.for_spec(plan.spec)
    valkey_url = stack.require_valkey() if backend.local_stack else stack.valkey_url()
    if plan.in_task_images:
        from dispatcher import images

        with store.connect() as conn:  # locally, build what is missing (reusing the rest); on AWS, the build tier's
            found, problems = images.for_plan(plan, conn, build=backend.builds_images)
        if problems:
            print_problems("a task image", problems)
            raise typer.Exit(EXIT_SPEC)
        plan.task_images = {iid: t.ref for iid, t in found.items()}
    try:
        state = execute(plan, valkey_url, err)
    except RunConflict as e:
        raise Refused(str(e), EXIT_CONFLICT) from None
    if state == "finished":
        err.print(f"run {plan.spec.run.name!r} is finished")
    write_outputs(plan, out_dir)


def run(spec: Annotated[str, typer.Argument(metavar="SPEC", help="a spec file", show_default=False)],
        out_dir: OUT = None) -> None:
    """Run (or resume) the evaluation a spec describes; prints the results table."""
    _drive(target.load_plan(spec), spec, out_dir)


def resume(run_or_spec: RUN_OR_SPEC, out_dir: OUT = None) -> None:
    """Resume an unfinished run (after a crash or kill of its driver).

    A run resumes from the spec file it was started with; given the run's name, that file is asked for."""
    it = target.resolve(run_or_spec)
    with store.connect() as conn:
        if store.run_status(conn, it.run) is None:
            raise Refused(f"no run named {it.run!r} to resume; use `run`")
    if it.plan is None:  # the stored spec has its paths resolved: its hash is not the run's, the driver would refuse
        raise Refused(f"run {it.run!r} resumes from the spec file it was started with: `resume SPEC`", EXIT_SPEC)
    _drive(it.plan, run_or_spec, out_dir)


def cancel(run_or_spec: RUN_OR_SPEC) -> None:
    """Cancel a running run.

    Its driver stops launching, stops the running tasks and lands the rest as cancelled."""
    run = target.resolve(run_or_spec).run
    with store.connect() as conn:
        cancelled = store.cancel(conn, run)
    if not cancelled:
        err.print(f"no running run named {run!r}")
        raise typer.Exit(1)
    out.print(f"run {run!r} cancelled; its driver lands the remaining attempts as cancelled"
              " (run `resume` if no driver is running)")


def status(run_or_spec: Annotated[str | None, typer.Argument(metavar="[RUN_OR_SPEC]", help=target.HELP)] = None
           ) -> None:
    """List runs and their progress (every run, or the one named)."""
    run = target.resolve(run_or_spec).run if run_or_spec else None
    with store.connect() as conn:
        runs = store.progress(conn, run)
    for r in runs:
        out.print(f"{r.run}: {r.status}, {r.landed}/{r.planned} attempts landed, {r.resolved} resolved, "
                  f"${r.cost_usd:.6f}, created {r.created_at:%Y-%m-%d %H:%M}")
    if run and not runs:
        err.print(f"no run named {run!r}")
        raise typer.Exit(1)


def dashboard(host: Annotated[str, typer.Option(help="the address to serve on")] = "127.0.0.1",
              port: Annotated[int, typer.Option(help=f"0 = any free port (default {DASHBOARD_PORT})")] = DASHBOARD_PORT,
              port_file: Annotated[str | None, typer.Option(help="write the dashboard's URL here once it serves")]
              = None) -> None:
    """Serve the live dashboard (reads Valkey only).

    It serves until interrupted (SIGINT/SIGTERM)."""
    import asyncio
    import signal

    from dispatcher.dashboard.app import serve

    valkey_url = stack.require_valkey()

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await serve(valkey_url, host, port, Path(port_file) if port_file else None, stop)

    try:
        asyncio.run(main())
    except OSError as e:
        raise Refused(f"cannot serve on {host}:{port}: {e}") from None
