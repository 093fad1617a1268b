"""A run's life: `run` and `resume` drive it, `pause`, `resume`, `resize` and `cancel` steer it while it goes, `retry`
relaunches what infrastructure broke, `status` and `dashboard` watch it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dispatcher import backends, store
from dispatcher.cli import stack, target
from dispatcher.cli.errors import EXIT_CONFLICT, EXIT_SPEC, Refused
from dispatcher.cli.output import err, out, print_problems
from dispatcher.cli.results import OUT, print_forecast_check, write_outputs
from dispatcher.launchers.process import agent_isolation_problem
from dispatcher.plan import Plan, apply_validation
from dispatcher.spec import SpecError

DASHBOARD_PORT = 8270  # dispatcher.dashboard.app.DEFAULT_PORT (not imported: aiohttp is not needed by every command)
RUN_OR_SPEC = Annotated[str, typer.Argument(metavar="RUN_OR_SPEC", help=target.HELP, show_default=False)]


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
    _keep_forecast(plan)
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
    print_forecast_check(plan.spec.run.name)


def _keep_forecast(plan: Plan) -> None:
    """A new run's forecast, made before anything is built or launched, for `report` to set against the run."""
    import redis

    from dispatcher import forecast

    with store.connect() as conn:
        if store.run_exists(conn, plan.spec.run.name):
            return
        try:
            made = forecast.make(conn, plan, len(plan.refs))
        except redis.RedisError as e:  # the forecast reads the pool's live limits; the run does not need it
            err.print(f"[yellow]warning:[/] no forecast kept for the run: {e}", soft_wrap=True)
            return
        forecast.record(conn, plan.spec.run.name, made)


def run(spec: Annotated[str, typer.Argument(metavar="SPEC", help="a spec file", show_default=False)],
        out_dir: OUT = None) -> None:
    """Run (or resume) the evaluation a spec describes; prints the results table."""
    _drive(target.load_plan(spec), spec, out_dir)


def resume(run_or_spec: RUN_OR_SPEC, out_dir: OUT = None) -> None:
    """Lift a run's pause (and its call hold); or, for a run not paused, drive it again from its spec file (after its
    driver was killed).

    A paused run's driver launches again once resumed, and its shims let held calls go on; one that is not running
    stays paused when it is started again (`run SPEC`), until `resume`. A run is driven again from the spec file it
    was started with."""
    it = target.resolve(run_or_spec)
    with store.connect() as conn:
        control = store.control(conn, it.run)
        if control is None:
            raise Refused(f"no run named {it.run!r} to resume; use `run`")
        valkey = _valkey() if control.hold_calls else None  # the shims learn of the lifted hold there
        if control.paused and store.set_paused(conn, it.run, False, valkey=valkey):
            held = ", its shims' held calls go on" if control.hold_calls else ""
            out.print(f"run {it.run!r} resumed: its driver launches again{held} (if none runs: `resume SPEC`)")
            return
    if it.plan is None:  # the stored spec has its paths resolved: its hash is not the run's, the driver would refuse
        raise Refused(f"run {it.run!r} resumes from the spec file it was started with: `resume SPEC`", EXIT_SPEC)
    _drive(it.plan, run_or_spec, out_dir)


def _steer(run_or_spec: str, change) -> str:
    """Apply `change(conn, run)` to the run named; Refused (exit 1) if it is not running. Returns the run."""
    run = target.resolve(run_or_spec).run
    with store.connect() as conn:
        if not change(conn, run):
            raise Refused(f"no running run named {run!r}")
    return run


def _valkey():
    """A client of the Valkey the run's shims read (the admin's: it may set and lift a run's call hold)."""
    import redis

    return redis.Redis.from_url(stack.require_valkey(), socket_timeout=stack.PING_TIMEOUT_S)


def pause(run_or_spec: RUN_OR_SPEC,
          hold_calls: Annotated[bool, typer.Option(
              "--hold-calls", help="the running attempts' shims also hold each new model call until `resume`"
                                   " (a call already upstream finishes; time held is not the attempt's wall time)")]
          = False) -> None:
    """Pause a running run: its driver launches nothing new until `resume`; running attempts go on and land (with
    --hold-calls, their next model call waits in the shim until `resume`).

    The pause is the run's (stored with it): a driver started again on a paused run stays paused, and a hold stays
    set whether a driver runs or not."""
    valkey = _valkey() if hold_calls else None
    run = _steer(run_or_spec, lambda conn, run: store.set_paused(conn, run, True, hold_calls, valkey))
    if hold_calls:
        out.print(f"run {run!r} paused, calls held: nothing new is launched and the running attempts' next model call"
                  f" waits until `resume {run}`")
    else:
        out.print(f"run {run!r} paused: nothing new is launched until `resume {run}`; running attempts finish")


def resize(run_or_spec: RUN_OR_SPEC,
           concurrency: Annotated[int, typer.Argument(metavar="N", min=1, help="the most tasks at once")]) -> None:
    """Set the concurrency ceiling the run's planner works under (instead of the spec's backend.concurrency).

    Its driver plans under it within one pass: more tasks are launched at once, or none until fewer run."""
    run = _steer(run_or_spec, lambda conn, run: store.resize(conn, run, concurrency))
    out.print(f"run {run!r}: at most {concurrency} task(s) at once")


def retry(run_or_spec: RUN_OR_SPEC,
          status: Annotated[list[str] | None, typer.Option(
              "--status", help="a status (infra_error, eval_error, ...) or an infrastructure class (lost_result,"
                               " rate_limited, task_died, ...) to relaunch; repeatable (default infra_error)")]
          = None,
          out_dir: OUT = None) -> None:
    """Relaunch, as new attempt numbers, the attempts that ended in an infrastructure class (or the classes named).

    Each retry takes its attempt's slot: the results, the official outputs and pass@k count the slot's latest attempt;
    the superseded one stays in the rows. Only as many as the run's remaining budget covers at budget.attempt_usd
    are relaunched. With the spec file the run is driven at once; with its name a driver running it takes them on,
    else `resume SPEC` does."""
    from dispatcher.retry import pick

    it = target.resolve(run_or_spec)
    plan = target.plan_of(it)
    budget = plan.spec.budget
    with store.connect() as conn:
        if store.run_status(conn, it.run) in (None, "cancelled"):
            raise Refused(f"no run named {it.run!r} to retry (or it was cancelled)")
        picks, left_out = pick(store.current_attempts(conn, it.run), {s.lower() for s in status or ["infra_error"]},
                               budget.run_usd - store.spent_usd(conn, it.run), budget.attempt_usd)
        new = store.add_retries(conn, it.run, picks)
    for (iid, attempt, _, reason), (_, n) in zip(picks, new):
        out.print(f"{iid} attempt {attempt} ({reason}): relaunched as attempt {n}", highlight=False)
    if left_out:
        err.print(f"[yellow]warning:[/] {left_out} attempt(s) left out: the run's remaining budget does not cover"
                  " them at budget.attempt_usd", soft_wrap=True)
    if not new:
        out.print(f"run {it.run!r}: nothing to retry")
        return
    if it.plan is None:
        out.print(f"run {it.run!r}: {len(new)} attempt(s) to relaunch; a driver running it takes them on, else"
                  " `resume SPEC` launches them")
        return
    _drive(it.plan, run_or_spec, out_dir)


def cancel(run_or_spec: RUN_OR_SPEC) -> None:
    """Cancel a running run.

    Its driver stops launching, stops the running tasks and lands the rest as cancelled."""
    run = _steer(run_or_spec, store.cancel)
    out.print(f"run {run!r} cancelled; its driver lands the remaining attempts as cancelled"
              " (run `resume` if no driver is running)")


def status(run_or_spec: Annotated[str | None, typer.Argument(metavar="[RUN_OR_SPEC]", help=target.HELP)] = None
           ) -> None:
    """List runs and their progress (every run, or the one named)."""
    run = target.resolve(run_or_spec).run if run_or_spec else None
    with store.connect() as conn:
        runs = store.progress(conn, run)
    for r in runs:
        state = r.status
        if r.paused and r.status == "running":
            state = "paused (calls held)" if r.hold_calls else "paused"
        ceiling = f", at most {r.concurrency} at once" if r.concurrency else ""
        out.print(f"{r.run}: {state}{ceiling}, {r.landed}/{r.planned} attempts landed, {r.resolved} resolved, "
                  f"${r.cost_usd:.6f}, created {r.created_at:%Y-%m-%d %H:%M}")
    if run and not runs:
        err.print(f"no run named {run!r}")
        raise typer.Exit(1)


def dashboard(host: Annotated[str, typer.Option(help="the address to serve on")] = "127.0.0.1",
              port: Annotated[int, typer.Option(help=f"0 = any free port (default {DASHBOARD_PORT})")] = DASHBOARD_PORT,
              port_file: Annotated[str | None, typer.Option(help="write the dashboard's URL here once it serves")]
              = None,
              token_file: Annotated[str | None, typer.Option(
                  help="the control token: read from this 0600 file (created with a new token if missing)")] = None,
              read_only: Annotated[bool, typer.Option("--read-only", help="no control token: nothing can be changed")]
              = False) -> None:
    """Serve the live dashboard (reads Valkey; its pause/resume/resize/cancel buttons write the run's control state).

    The buttons need the dashboard's control token: a new one printed at start, or the one in --token-file. It
    serves until interrupted (SIGINT/SIGTERM)."""
    import asyncio
    import signal

    from dispatcher.dashboard.app import TokenFileError, load_token, serve

    valkey_url = stack.require_valkey()
    token = None
    if not read_only:
        try:
            token = load_token(Path(token_file) if token_file else None)
        except (TokenFileError, OSError) as e:
            raise Refused(f"--token-file: {e}", EXIT_SPEC) from None
        if token_file is None:
            err.print(f"dashboard control token: {token}", highlight=False)

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await serve(valkey_url, host, port, Path(port_file) if port_file else None, stop, token)

    try:
        asyncio.run(main())
    except OSError as e:
        raise Refused(f"cannot serve on {host}:{port}: {e}") from None
