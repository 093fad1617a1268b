"""Before a run: `validate` (would it start?), `forecast` (fleet, time, cost) and `images` (its task images)."""

from __future__ import annotations

import logging
import time
from typing import Annotated

import typer

from dispatcher import backends, store
from dispatcher.cli import stack, target
from dispatcher.cli.errors import EXIT_SPEC
from dispatcher.cli.output import err, out, print_problems
from dispatcher.launchers import launcher_class
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


def _pool_limits(spec) -> tuple[dict[str, int], str]:
    """The limits the pool runs under, and where they come from: its pacer's (Valkey), else what the shims
    discovered from provider headers on top of the spec's, else the spec's alone."""
    import redis

    from contract import keys
    from dispatcher.driver.pacing import PacerPolicy

    limits = {k: v for k, v in {"rpm": spec.model.rpm, "itpm": spec.model.itpm, "otpm": spec.model.otpm}.items() if v}
    # the pool's live limits are what the forecast is of: without Valkey it would forecast another fleet
    r = redis.Redis.from_url(stack.valkey_url(), decode_responses=True)
    stored = r.hgetall(keys.pool_limits(spec.pool))
    discovered = PacerPolicy().discovered(r.hgetall(keys.pool_discovered(spec.pool)))
    if stored:
        return {k: int(v) for k, v in stored.items()}, "the pool's pacer"
    if discovered:
        return limits | discovered, "provider headers the shims recorded"
    return limits, "spec"


def forecast(run_or_spec: Annotated[str, typer.Argument(metavar="RUN_OR_SPEC", help=target.HELP)]) -> None:
    """Predict fleet size, wall time and cost before launching anything.

    From the pool's limits (its pacer's, in Valkey; else the spec's) and its ledger's call shape."""
    from contract import pricing
    from dispatcher.driver.fleet import observe, predict

    plan = target.plan_of(target.resolve(run_or_spec))
    spec = plan.spec
    with store.connect() as conn:
        obs = observe(conn, spec.pool)
        done = store.attempts_landed(conn, spec.run.name)
    limits, source = _pool_limits(spec)
    try:
        price = pricing.price(spec.model.model, spec.model.provider)
    except pricing.UnknownModel:
        price = None
    todo = len(plan.refs) - done
    # a launcher paced to a quota (ECS) launches no faster than it; the others report their rate as they run
    paced = launcher_class(spec).paced
    p = predict(max(todo, 0), limits, obs, price, spec.backend.concurrency, spec.budget.run_usd,
                spec.backend.launch_rate_per_s if paced else None, spec.backend.launch_burst)
    lim = ", ".join(f"{k} {v}" for k, v in limits.items()) or "none known (unpaced)"
    out.print(f"run {spec.run.name}: {len(plan.refs)} attempt(s) ({len(plan.rows)} instance(s) x {spec.run.attempts}),"
              f" {done} already landed, {todo} to run", soft_wrap=True)
    out.print(f"pool {spec.pool}: limits {lim} (from {source}); call shape from the {p.basis}", soft_wrap=True)
    out.print(f"  per attempt: {obs.calls_per_attempt:.1f} calls, {obs.attempt_minutes:.1f} min; per call:"
              f" {obs.input_per_call:.0f} input, {obs.cached_per_call:.0f} cached, {obs.output_per_call:.0f} output"
              f" tokens", soft_wrap=True)
    if todo <= 0:
        out.print("nothing left to run")
        return
    fed = "unbounded" if p.feedable == float("inf") else f"{p.feedable:.0f}"
    out.print(f"predicted fleet: {p.concurrency} concurrent task(s) (limits can feed {fed};"
              f" spec allows {spec.backend.concurrency})", soft_wrap=True)
    if paced:
        out.print(f"predicted launch time: {p.launch_s / 60:.1f} min to start {todo} task(s) at the ECS launch quota"
                  f" ({spec.backend.launch_rate_per_s:g} tasks/s after a burst of {spec.backend.launch_burst};"
                  f" backend.launch_rate_per_s, backend.launch_burst)", soft_wrap=True)
    out.print(f"predicted wall time: {p.wall_time_s / 60:.1f} min"
              + (" (launch time included)" if p.launch_s else ""), soft_wrap=True)
    cost = "unknown (model not in the price table)" if price is None else f"${p.cost_usd:.4f}" + (
        f" (capped by the run budget ${spec.budget.run_usd})" if p.capped_by_budget else "")
    out.print(f"predicted cost: {cost}", soft_wrap=True)
    refuse_what_cannot_start(plan)


def images(spec: SPEC,
           force: Annotated[bool, typer.Option("--force", help="rebuild even where the inputs did not change")] = False
           ) -> None:
    """Build (or reuse) each instance's task image, push it, record its digest.

    Prints what it did: built or reused, per instance."""
    from rich.table import Table

    from dispatcher import images as task_images

    plan = target.load_plan(spec)
    logging.getLogger("evalplane.images").setLevel(logging.INFO)
    t0 = time.monotonic()
    with store.connect() as conn:
        built, problems = task_images.for_plan(plan, conn, build=True, force=force,
                                               on_image=lambda t: err.print(
                                                   f"{t.instance_id}: {'built' if t.built else 'reused'} {t.ref}",
                                                   markup=False, highlight=False, soft_wrap=True))
    table = Table(title=f"task images for {plan.spec.run.name} ({plan.spec.harness.name})")
    for col in ("instance", "image (by digest)", "", "build s", "layers MB", "image MB"):
        table.add_column(col, justify="right" if col.endswith(("s", "MB")) else "left")
    for iid, t in sorted(built.items()):
        table.add_row(iid, t.ref, "built" if t.built else "reused", f"{t.build_s:.1f}" if t.built else "-",
                      f"{t.layer_bytes / 1e6:.1f}", f"{t.size_bytes / 1e6:.0f}")
    out.print(table)
    n_built = sum(t.built for t in built.values())
    out.print(f"{n_built} built, {len(built) - n_built} reused, {len(problems)} missing, {time.monotonic() - t0:.1f} s")
    if problems:
        print_problems("a task image", problems)
        raise typer.Exit(1)
