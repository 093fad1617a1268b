"""Before a run: `validate` (would it start?), `forecast` (fleet, time, cost) and `images` (its task images)."""

from __future__ import annotations

import logging
import time
from typing import Annotated

import typer

from dispatcher import backends, store
from dispatcher.cli import target
from dispatcher.cli.errors import EXIT_SPEC
from dispatcher.cli.output import err, out, print_problems
from dispatcher.launchers.process import agent_isolation_problem
from dispatcher.plan import Plan

SPEC = Annotated[str, typer.Argument(metavar="SPEC", help="a spec file", show_default=False)]


def image_problems(plan: Plan) -> dict[str, str]:
    """What each instance lacks to run in its task image, without building anything (the backend says what)."""
    if not plan.in_task_images:
        return {}
    with store.connect():  # the image records are in PostgreSQL: down, that is the one problem to name
        pass
    return backends.for_spec(plan.spec).image_problems(plan)


def refuse_what_cannot_start(plan: Plan) -> None:
    """The checks `validate` and `forecast` end with: an agent the launcher cannot confine, instances without what
    their task image needs."""
    if problem := agent_isolation_problem(plan.spec):
        err.print(f"[bold red]refused:[/] {problem}", soft_wrap=True)
        raise typer.Exit(EXIT_SPEC)
    missing = image_problems(plan)
    if missing:
        print_problems("what their task image needs", missing)
        raise typer.Exit(EXIT_SPEC)


def validate(spec: SPEC) -> None:
    """Check a spec (and its instances) without running anything."""
    plan = target.load_plan(spec)
    refuse_what_cannot_start(plan)
    out.print(f"{spec}: ok: run {plan.spec.run.name!r}, {len(plan.rows)} instance(s), "
              f"{len(plan.refs)} attempt(s), pool {plan.spec.pool!r}, backend {plan.spec.backend.kind}, "
              f"launcher {plan.spec.backend.launcher}")


def forecast(run_or_spec: Annotated[str, typer.Argument(metavar="RUN_OR_SPEC", help=target.HELP)]) -> None:
    """Predict fleet size, wall time and cost before launching anything.

    From the pool's limits (its pacer's, in Valkey; else the spec's) and the most relevant ledger's call shape."""
    from contract import compute_prices
    from dispatcher import forecast as forecasting

    plan = target.plan_of(target.resolve(run_or_spec))
    spec = plan.spec
    with store.connect() as conn:
        done = store.attempts_landed(conn, spec.run.name)
        todo = max(len(plan.refs) - done, 0)
        f = forecasting.make(conn, plan, todo)
    obs = f.observation
    lim = ", ".join(f"{k} {v}" for k, v in f.limits.items()) or "none known (unpaced)"
    out.print(f"run {spec.run.name}: {len(plan.refs)} attempt(s) ({len(plan.rows)} instance(s) x {spec.run.attempts}),"
              f" {done} already landed, {todo} to run", soft_wrap=True)
    out.print(f"pool {spec.pool}: limits {lim} (from {f.limits_source}); call shape from the {obs.basis}",
              soft_wrap=True)
    out.print(f"  per attempt: {obs.calls_per_attempt:.1f} calls, {obs.attempt_minutes:.1f} min; per call:"
              f" {obs.input_per_call:.0f} input, {obs.cached_per_call:.0f} cached, {obs.output_per_call:.0f} output"
              f" tokens; {obs.graded_share:.0%} graded, {obs.grading_minutes:.1f} min each", soft_wrap=True)
    if todo <= 0:
        out.print("nothing left to run")
        return
    fed = "unbounded" if f.feedable is None else f"{f.feedable:.0f}"
    out.print(f"predicted fleet: {f.concurrency} concurrent task(s) (limits can feed {fed};"
              f" spec allows {spec.backend.concurrency})", soft_wrap=True)
    if f.launch_s:
        out.print(f"predicted launch time: {f.launch_s / 60:.1f} min to start {todo} task(s) at the ECS launch quota"
                  f" ({spec.backend.launch_rate_per_s:g} tasks/s after a burst of {spec.backend.launch_burst};"
                  f" backend.launch_rate_per_s, backend.launch_burst)", soft_wrap=True)
    build = "" if not f.images_to_build else (
        f"{f.image_build_s / 60:.1f} min building {f.images_to_build} task image(s), " if f.image_build_s is not None
        else f"building {f.images_to_build} task image(s) (not predicted), ")
    out.print(f"predicted wall time: {f.wall_time_s / 60:.1f} min ({build}{f.start_s:.0f} s start-up from"
              f" {f.start_basis}, {f.attempts_s / 60:.1f} min of attempts"
              + (" with the launch time" if f.launch_s else "")
              + f", {f.grading_s / 60:.1f} min of grading after them at {spec.eval.workers} eval worker(s))",
              soft_wrap=True)
    cost = "unknown (model not in the price table)" if f.token_usd is None else f"${f.token_usd:.4f}" + (
        f" (capped by the run budget ${spec.budget.run_usd})" if f.capped_by_budget else "")
    out.print(f"predicted cost: {cost}", soft_wrap=True)
    out.print(f"run cap ${spec.budget.run_usd:g} held by {spec.cap_holder()}", soft_wrap=True)
    if f.gateway is not None:
        g = f.gateway
        out.print(f"gateway tier: {g.replicas} replica(s) for {g.calls_per_s:.1f} calls/s at the predicted fleet"
                  f" (a replica serves {g.replica_calls_per_s:g} calls/s flat out, sized to half of it;"
                  f" gateway.replica_calls_per_s)", soft_wrap=True)
    c, r = f.compute, f.compute.resources
    out.print(f"predicted compute cost: ${c.total_usd:.4f} (tasks ${c.task_usd:.4f} at {r.cpu:g} vCPU,"
              f" {r.memory_limit_mib} MiB; grading ${c.grading_usd:.4f} at {obs.grading_minutes:.1f} min each;"
              f" {compute_prices.price_file().name})", soft_wrap=True)
    if c.spot_share:
        out.print(f"Fargate Spot for {c.spot_share:.0%} of tasks: expected saving ${c.spot_saving_usd:.4f}"
                  " on tasks (Spot rates of the price table; interrupted attempts are relaunched once)",
                  soft_wrap=True)
    if plan.in_task_images:
        _forecast_images(plan)
    refuse_what_cannot_start(plan)


def _forecast_images(plan: Plan) -> None:
    """The task images' part of the forecast: their build time and what they add to the registry."""
    from dispatcher import images as task_images

    with store.connect() as conn:
        f = task_images.forecast_build(conn, plan.spec.harness.name, len(plan.rows), plan.spec.images.build_parallel)
    if f.build_s is None:
        out.print(f"predicted task image build: unknown ({f.basis}; `python -m dispatcher images SPEC` builds them)",
                  soft_wrap=True)
        return
    out.print(f"predicted task image build: {f.build_s / 60:.1f} min for {f.images} image(s), {f.parallel} at a time"
              f" (images.build_parallel; from {f.basis}; reused images take none)", soft_wrap=True)
    out.print(f"predicted registry bytes: {f.registry_bytes / 1e6:.1f} MB uncompressed ({f.shared_bytes / 1e6:.1f} MB"
              f" of runtime and harness layers once, {f.own_bytes / 1e6:.2f} MB per image)", soft_wrap=True)


def images(spec: SPEC,
           force: Annotated[bool, typer.Option("--force", help="rebuild even where the inputs did not change")] = False,
           parallel: Annotated[int | None, typer.Option(
               "--parallel", min=1, max=64, help="task images built at once (default: the spec's [images] "
               "build_parallel)", show_default=False)] = None,
           ) -> None:
    """Build (or reuse) each instance's task image, push it, record its digest.

    Prints what it did: built or reused, per instance; then images per minute and bytes."""
    from rich.table import Table

    from dispatcher import images as task_images

    plan = target.load_plan(spec)
    logging.getLogger("evalplane.images").setLevel(logging.INFO)
    t0 = time.monotonic()
    with store.connect() as conn:
        done = task_images.build_for_plan(plan, conn, force=force, parallel=parallel,
                                          on_image=lambda t: err.print(
                                              f"{t.instance_id}: {'built' if t.built else 'reused'} {t.ref}",
                                              markup=False, highlight=False, soft_wrap=True))
    built, problems = done.images, done.problems
    table = Table(title=f"task images for {plan.spec.run.name} ({plan.spec.harness.name})")
    for col in ("instance", "image (by digest)", "", "build s", "layers MB", "own kB", "image MB"):
        table.add_column(col, justify="right" if col.endswith(("s", "B")) else "left")
    for iid, t in sorted(built.items()):
        table.add_row(iid, t.ref, "built" if t.built else "reused", f"{t.build_s:.1f}" if t.built else "-",
                      f"{t.layer_bytes / 1e6:.1f}", "-" if t.own_bytes is None else f"{t.own_bytes / 1e3:.0f}",
                      f"{t.size_bytes / 1e6:.0f}")
    out.print(table)
    n_built = len(done.built)
    out.print(f"{n_built} built, {len(built) - n_built} reused, {len(problems)} missing, {time.monotonic() - t0:.1f} s")
    rate = done.images_per_minute()
    out.print(f"task images: {done.seconds:.1f} s, {done.parallel} at a time"
              + (f", {rate:.1f} images per minute" if rate else " (none built)"), soft_wrap=True)
    if done.runtime is not None:
        own = sum(t.own_bytes or 0 for t in built.values())
        out.print(f"bytes (uncompressed): {done.runtime.shared_bytes / 1e6:.1f} MB shared by every task image of"
                  f" {plan.spec.harness.name} (runtime and harness layers, stored once), {own / 1e3:.0f} kB of"
                  f" their own in {len(built)} image(s)", soft_wrap=True)
    if problems:
        print_problems("a task image", problems)
        raise typer.Exit(1)
