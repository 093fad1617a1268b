"""RUN_OR_SPEC, the argument of every command that acts on a run: the run's name, or a spec file whose run.name
names it. `resolve` is the one reading of it; `plan_of` gives the plan either way (a run's own stored spec)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dispatcher import store
from dispatcher.cli.errors import EXIT_SPEC, Refused
from dispatcher.plan import Plan, make_plan
from dispatcher.spec import RUN_NAME, Spec, SpecError, load_spec

HELP = "a run's name, or the spec file of a run (its run.name)"


@dataclass(frozen=True)
class RunOrSpec:
    run: str
    spec_file: str | None = None  # None: named by the run's name
    plan: Plan | None = None  # the spec file's plan

    def describe(self) -> str:
        return self.spec_file or f"run {self.run!r}"


def load_plan(spec_file: str) -> Plan:
    """The plan of a spec file; SpecError lists every problem in it."""
    return make_plan(load_spec(spec_file), spec_file)


def resolve(target: str) -> RunOrSpec:
    """A path ending .toml, or any existing file, is a spec (SpecError if it does not load, a missing file among
    them); otherwise a run's name. Refused when it is neither."""
    if target.endswith(".toml") or Path(target).is_file():
        plan = load_plan(target)
        return RunOrSpec(plan.spec.run.name, target, plan)
    if RUN_NAME.match(target):
        return RunOrSpec(target)
    raise Refused(f"{target!r} is neither a spec file nor a run name (no such file; a run's name is 1-40 characters"
                  " of a-z, 0-9 and '-')", EXIT_SPEC)


def stored_plan(conn, run: str) -> Plan:
    """The plan of a run from the spec its row stores (its paths are absolute). Refused for no such run, or when that
    spec no longer loads (a dataset moved)."""
    from pydantic import ValidationError

    row = store.stored_spec(conn, run)
    if row is None:
        raise Refused(f"no run named {run!r}")
    try:
        return make_plan(Spec.model_validate(row[1], context={"base_dir": "/"}))
    except (ValidationError, SpecError) as e:
        raise Refused(f"run {run!r}: its stored spec no longer loads: {str(e).splitlines()[0]}") from None


def plan_of(target: RunOrSpec) -> Plan:
    """The spec file's plan, or the named run's stored one."""
    if target.plan is not None:
        return target.plan
    with store.connect() as conn:
        return stored_plan(conn, target.run)
