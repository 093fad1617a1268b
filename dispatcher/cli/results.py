"""After a run: `report` (its figures, and the official outputs) and `judge` (a model's verdict per trajectory)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import typer

from contract import db, task_shape
from contract.models import AttemptRef
from dispatcher import backends, store
from dispatcher.backends import BACKENDS, daemons
from dispatcher.cli import stack, target
from dispatcher.cli.errors import EXIT_SPEC, Refused
from dispatcher.cli.output import err, out, plain
from dispatcher.plan import Plan

RUN_OR_SPEC = Annotated[str, typer.Argument(metavar="RUN_OR_SPEC", help=target.HELP, show_default=False)]
OUT = Annotated[str | None, typer.Option("--out", help="folder for predictions.jsonl and the report JSON")]


def write_outputs(plan: Plan, out_dir: str | None) -> None:
    """The run's official outputs (predictions.jsonl, the SWE-bench report JSON), and its results table."""
    from dispatcher import report
    from dispatcher.backends import resources
    from dispatcher.report.reconcile import reconcile

    run = plan.spec.run.name
    with store.connect() as conn:
        attempts = report.fetch_attempts(conn, run)
        meters = reconcile(conn, run)
    bucket = backends.for_spec(plan.spec).bucket()  # locally, its S3 server started if it is not running
    dest = Path(out_dir) if out_dir else daemons.state_dir() / "runs" / run / "results"
    files = report.write_outputs(run, attempts, list(plan.rows.values()), dest, plan.spec.run.attempts,
                                 lambda iid, n: resources.artifacts_prefix(
                                     bucket, AttemptRef(run=run, instance_id=iid, attempt=n)), meters)
    report.print_results(out, run, attempts, files, meters)


def print_forecast_check(run: str) -> None:
    """The forecast the run started with against what it took (nothing for a run started without one)."""
    from rich.table import Table

    from dispatcher import forecast

    with store.connect() as conn:
        f = forecast.recorded(conn, run)
        if f is None:
            return
        lines = forecast.against(f, forecast.actual(conn, run, since=f.made_at))

    table = Table(title=f"{run}: predicted against actual (forecast of {f.made_at:%Y-%m-%d %H:%M}, call shape from"
                        f" the {f.observation.basis})")
    for col in ("", "predicted", "actual", "actual / predicted"):
        table.add_column(col, justify="left" if not col else "right")
    for ln in lines:
        table.add_row(ln.label, ln.text(ln.predicted), ln.text(ln.actual),
                      "–" if ln.ratio is None else f"{ln.ratio:.2f}")
    out.print(table)


def report(run_or_spec: RUN_OR_SPEC,
           compare: Annotated[str | None, typer.Option(
               metavar="RUN_B", help="compare with another run: paired, on their shared instances")] = None,
           gradings: Annotated[bool, typer.Option(
               "--gradings", help="compare the run's gradings instead: its first verdicts against its latest (after"
                                  " `regrade`), the ones that changed")] = False,
           out_dir: Annotated[str | None, typer.Option(
               "--out", help="folder for the outputs (the report goes to its report/ subfolder)")] = None) -> None:
    """A run's report (figures, pass@k, plots, one HTML file); with a spec, its official outputs too.

    With a spec file, its run's official outputs are written again first; with a run's name too, where the spec the
    run stored still loads. --compare: the two runs side by side, paired on their shared instances."""
    from dispatcher.report import analytics
    from dispatcher.report.figures import NoSuchRun

    it = target.resolve(run_or_spec)
    plan = it.plan
    if gradings:  # two gradings of one run: which verdicts the latest changed
        with store.connect() as conn:
            if not store.run_exists(conn, it.run):
                raise Refused(f"no run named {it.run!r}")
            print_regradings(conn, it.run)
        return
    with store.connect() as conn:
        for name in filter(None, (it.run, compare)):
            if not store.run_exists(conn, name):
                raise Refused(f"no run named {name!r}")
        if plan is None:
            try:
                plan = target.stored_plan(conn, it.run)
            except Refused as e:  # the report needs only the rows; the official outputs need the dataset's too
                err.print(f"[yellow]warning:[/] {e.message}, so the official outputs are not rewritten (`report SPEC`"
                          " does)", soft_wrap=True)
    if plan is not None and not compare:
        write_outputs(plan, out_dir)
    dest = Path(out_dir) / "report" if out_dir else daemons.state_dir() / (
        f"reports/{it.run}-vs-{compare}" if compare else f"runs/{it.run}/report")
    with store.connect() as conn:
        try:
            built, files = analytics.build(conn, it.run, dest, compare)
        except (NoSuchRun, ValueError) as e:
            raise Refused(str(e)) from None
    analytics.print_summary(out, built, files)
    for name in filter(None, (it.run, compare)):
        print_forecast_check(name)
    if not compare:
        from dispatcher.report.reconcile import print_reconciliation, reconcile

        with store.connect() as conn:
            meters = reconcile(conn, it.run)
        if meters.through_gateway:  # a run without the gateway tier has one meter: nothing to reconcile
            print_reconciliation(out, meters)
    with store.connect() as conn:
        print_regradings(conn, it.run)


def regrade(run_or_spec: RUN_OR_SPEC,
            from_logs: Annotated[bool, typer.Option(
                "--from-logs", help="parse each grading's recorded test output again with the installed swebench"
                                    " (no containers)")] = False,
            images: Annotated[list[str] | None, typer.Option(
                "--images", metavar="INSTANCE=IMAGE", help="grade INSTANCE's patches again in IMAGE (by digest) with"
                                                           " the docker grader; repeatable")] = None,
            out_dir: OUT = None) -> None:
    """Grade a run's recorded patches again: from its logs, or in other images.

    Each new verdict is kept beside the earlier ones with the grader's version, the image digest and the time (none is
    overwritten); the results, the report and the official outputs (rewritten here) use each attempt's latest."""
    from dispatcher import regrade as regrading
    from dispatcher.backends import resources

    if from_logs == bool(images):
        raise Refused("give exactly one of --from-logs and --images", EXIT_SPEC)
    chosen = {}
    for item in images or []:
        iid, sep, image = item.partition("=")
        if not sep or not iid or not image:
            raise Refused(f"--images {item!r}: expected INSTANCE=IMAGE", EXIT_SPEC)
        chosen[iid] = image
    it = target.resolve(run_or_spec)
    plan = target.plan_of(it)
    if unknown := sorted(set(chosen) - set(plan.rows)):
        raise Refused(f"--images: not instances of run {it.run!r}: {', '.join(unknown)}", EXIT_SPEC)
    bucket = backends.for_spec(plan.spec).bucket()

    def prefix(ref: AttemptRef) -> str:
        return resources.artifacts_prefix(bucket, ref)

    with store.connect() as conn:
        if from_logs:
            done = regrading.from_logs(conn, plan, prefix)
        else:
            from eval_worker import package_index
            from eval_worker.graders import GRADERS, GraderOptions

            grader = GRADERS.get("docker").from_options(GraderOptions(
                database_url=db.database_url(), package_index=os.environ.get(package_index.PACKAGE_INDEX_ENV)))
            logs = daemons.state_dir() / "runs" / it.run / "regrade"
            done = regrading.on_images(conn, plan, chosen, prefix, grader, logs, plan.spec.eval.timeout_s)
    for r in done:
        change = "" if r.after is None or r.after == r.before else "  (changed)"
        plain(out, f"{r.ref.slug}: {r.before} -> {r.after or 'not regraded: ' + r.why}{change}")
    regraded = [r for r in done if r.after is not None]
    plain(out, f"run {it.run}: {len(regraded)} verdict(s) recorded, "
               f"{sum(r.after != r.before for r in regraded)} changed, {len(done) - len(regraded)} not regraded")
    write_outputs(plan, out_dir)


def print_regradings(conn, run: str) -> None:
    """The attempts whose verdict a regrade changed: first and latest, and how the latest was given."""
    from dispatcher.regrade import changes

    rows = changes(conn, run)
    if not rows:
        return
    plain(out, f"verdicts changed by regrading ({len(rows)}):")
    for c in rows:
        plain(out, f"  {c['instance_id']} attempt {c['attempt']}: {c['first']} -> {c['latest']} ({c['how']},"
                   f" {c['grader_version']}{', image ' + c['image_digest'] if c['image_digest'] else ''},"
                   f" {c['graded_at']:%Y-%m-%d %H:%M:%S})")


def judge(run_or_spec: RUN_OR_SPEC,
          rubric: Annotated[str | None, typer.Option(
              help="a TOML rubric (or s3:// URI of one); default: solved, looked_outside, tampered_tests")] = None,
          provider: Annotated[Literal["openai", "anthropic"], typer.Option()] = "openai",
          model: Annotated[str, typer.Option(help="the judge's model (priced from LiteLLM's table)")] = "gpt-4o-mini",
          base_url: Annotated[str | None, typer.Option(
              help="the gateway; unset with a local run: the provider simulator's judge policy")] = None,
          api_key_env: Annotated[str, typer.Option(
              help="env var with the judge's own provider key (a run on AWS: that key's name in the estate"
              " gateway's store)")] = task_shape.JUDGE_KEY_ENV,
          provider_url: Annotated[str | None, typer.Option(
              help="a run on AWS: the provider's endpoint, for the judge's deployment at the estate's gateway")]
          = None,
          budget_usd: Annotated[float, typer.Option(help="the judge's own budget for the pass")] = 1.0,
          attempt_usd: Annotated[float | None, typer.Option(help="a cap per judged trajectory")] = None,
          max_tokens: int = 1024,
          concurrency: int = 2,
          gateway: Annotated[bool | None, typer.Option(
              "--gateway/--no-gateway", help="through the gateway tier under a key of the judge's own, its"
              " budget --budget-usd (default: on for a local run whose spec has [gateway]; always on AWS)",
              show_default=False)] = None,
          here: Annotated[bool, typer.Option(
              "--here", help="judge in this process even for a run on AWS (the ECS task's)")] = False,
          alias: Annotated[str | None, typer.Option(
              help="with --here: the judge's alias at the gateway, its key in the secret named by"
              " $EVALPLANE_JUDGE_KEY_SECRET (what the dispatcher gives an estate's judge task)")] = None) -> None:
    """A model judges each attempt's trajectory against a rubric (one verdict row each).

    Every attempt of the run without a verdict for the rubric is judged: here, or in an ECS task for a run on AWS."""
    import secrets

    from pydantic import ValidationError

    from dispatcher.judge import rubric as rubrics
    from dispatcher.judge.runner import JudgePass, JudgeSettings, judge_run_name

    run = target.resolve(run_or_spec).run
    try:
        chosen = rubrics.load(_local_copy(rubric)) if rubric else rubrics.DEFAULT
    except rubrics.RubricError as e:
        plain(err, f"rubric: {e}")
        raise typer.Exit(EXIT_SPEC) from None
    with store.connect() as conn:
        row = store.stored_spec(conn, run)
    if row is None:
        raise Refused(f"no run named {run!r}")
    backend, spec = row
    try:  # the flags first: a bad one is refused before anything starts
        settings = JudgeSettings(provider=provider, model=model, upstream_url=base_url or "unset",
                                 budget_usd=budget_usd, attempt_usd=attempt_usd, max_tokens=max_tokens,
                                 concurrency=concurrency, valkey_url=stack.valkey_url())
    except ValidationError as e:
        for problem in e.errors():
            err.print(f"--{str(problem['loc'][0]).replace('_', '-')}: {problem['msg']}", highlight=False)
        raise typer.Exit(EXIT_SPEC) from None
    where = BACKENDS.get(backend)
    through_gateway = gateway if gateway is not None else where.local_stack and spec.get("gateway") is not None
    if not where.local_stack and not here:  # the judge runs where the run ran, beside its store
        from dispatcher.backends.stack_outputs import StackOutputsError
        from dispatcher.judge.ecs import launch, open_pass

        if gateway is False:
            raise Refused(f"--no-gateway: run {run!r} is on backend {backend!r}, whose judge task calls the estate's"
                          " gateway (it holds no provider key)", EXIT_SPEC)
        if not provider_url:
            raise Refused("--provider-url: on AWS the judge's deployment at the estate's gateway needs the"
                          " provider's endpoint", EXIT_SPEC)
        try:  # the pass's own key, minted before its task starts; the provider key stays with the gateway
            pass_alias, key_secret = open_pass(spec["backend"]["stack_outputs"], run, judge_run_name(run),
                                               db.database_url(), settings.valkey_url, provider, model, provider_url,
                                               api_key_env, budget_usd)
        except (StackOutputsError, RuntimeError) as e:
            raise Refused(str(e)) from None
        argv = judge_argv(run, rubric=rubric, provider=provider, model=model, base_url=base_url,
                          api_key_env=api_key_env, budget_usd=budget_usd, attempt_usd=attempt_usd,
                          max_tokens=max_tokens, concurrency=concurrency, alias=pass_alias)
        try:
            arn = launch(spec["backend"]["stack_outputs"], run, argv, chosen if rubric else None, key_secret)
        except RuntimeError as e:  # no task holds the key: refused from now on
            from dispatcher.judge.gateway import close_judge

            close_judge(db.database_url(), settings.valkey_url, judge_run_name(run))
            raise Refused(str(e)) from None
        out.print(f"judge task started for run {run!r} under its own gateway key (alias {pass_alias}): {arn}",
                  highlight=False, soft_wrap=True)
        return
    if through_gateway and not where.local_stack:  # --here: the task's key was minted by the dispatcher (--alias)
        raise Refused(f"--gateway: with --here the judge mints its own gateway key on the local tier only; run {run!r}"
                      f" is on backend {backend!r} (its judge task gets its key from the dispatcher: --alias)",
                      EXIT_SPEC)
    services = None
    if alias:  # an estate's judge task: its key was minted by the dispatcher, its calls go to the gateway
        from dispatcher.judge.ecs import pass_key

        if not base_url:
            raise Refused("--alias: the gateway's URL (--base-url) is required with it", EXIT_SPEC)
        try:
            upstream, key = base_url, pass_key()
        except RuntimeError as e:
            raise Refused(str(e), EXIT_SPEC) from None
        settings = settings.model_copy(update={"upstream_model": alias})
    elif base_url:
        upstream, key = base_url, os.environ.get(api_key_env, "")
        if not key:
            raise Refused(f"--api-key-env: environment variable {api_key_env} is not set", EXIT_SPEC)
    elif where.local_stack:
        from dispatcher.backends.local_services import LocalServices

        daemons.ensure_moto()
        services = LocalServices(daemons.state_dir() / "runs" / run / "judge")
        upstream, key = services.simulator(["--policy", "judge"], "sk-judge-" + secrets.token_hex(16))
    else:
        raise Refused("--base-url is required for a run on AWS", EXIT_SPEC)
    settings = settings.model_copy(update={"upstream_url": upstream})
    judge_run = judge_run_name(run)
    if through_gateway:  # SIGTERM ends the pass as Ctrl-C does: through the `finally` that revokes the key
        import signal

        signal.signal(signal.SIGTERM, _interrupted)
    try:
        if through_gateway:  # the shims get the judge's gateway key and alias; the provider key stays with the tier
            from dispatcher.judge.gateway import open_judge

            gw = open_judge(db.database_url(), settings.valkey_url, judge_run, f"{model}@judge", provider, model,
                            upstream, key, budget_usd, replicas=(spec.get("gateway") or {}).get("replicas", 2))
            settings, key = settings.model_copy(update={"upstream_url": gw.url, "upstream_model": gw.alias}), gw.key
        judging = JudgePass(run, chosen, settings, key, daemons.state_dir() / "judge", db.database_url())
        summary = judging.run_pass()
    finally:  # a killed pass leaves its simulator to the next one (LocalServices finds it); a finished one stops it
        if through_gateway:  # finished, failed or interrupted: the judge's key is refused from now on
            from dispatcher.judge.gateway import close_judge

            if not close_judge(db.database_url(), settings.valkey_url, judge_run):
                plain(err, f"some of {judge_run}'s gateway meter rows had not landed after 30 s")
        if services is not None:
            services.stop_all()
    out.print(f"run {run}, rubric {chosen.name} ({chosen.sha}): {summary.judged} judged,"
              f" {summary.parse_failures} parse failure(s), {summary.no_trajectory} without a trajectory,"
              f" {summary.over_attempt_cap} over the per-trajectory cap, {summary.left} left for a rerun;"
              f" calls in the ledger under run {judging.judge_run!r}"
              f"{' (through the gateway, key revoked)' if through_gateway else ''}", highlight=False, soft_wrap=True)
    for problem in summary.problems[:20]:
        plain(err, f"  {problem}")
    if summary.left:
        raise typer.Exit(1)


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def judge_argv(run: str, *, rubric: str | None, provider: str, model: str, base_url: str | None, api_key_env: str,
               budget_usd: float, attempt_usd: float | None, max_tokens: int, concurrency: int,
               alias: str | None = None) -> list[str]:
    """The judge's own command line, for the ECS task that runs it (`--here`: in that task)."""
    argv = ["judge", run, "--here", "--provider", provider, "--model", model, "--api-key-env", api_key_env,
            "--budget-usd", str(budget_usd), "--max-tokens", str(max_tokens), "--concurrency", str(concurrency)]
    for flag, value in (("--rubric", rubric), ("--base-url", base_url), ("--attempt-usd", attempt_usd),
                        ("--alias", alias)):
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
