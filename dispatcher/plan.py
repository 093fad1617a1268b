"""spec -> the attempts to run: instances selected, where each attempt's repository comes from. No side effects
(validate uses it). Task images are attached by dispatcher.images before a run (run_images)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from contract import task_shape
from contract.models import AttemptRef
from dispatcher import instances
from dispatcher.spec import Spec, SpecError, SpecProblem


@dataclass
class Plan:
    spec: Spec
    rows: dict[str, dict]  # instance_id -> dataset row
    repo_sources: dict[str, str]  # instance_id -> where its task gets the repository (a bundle, or TESTBED)
    refs: list[AttemptRef]
    bundles: dict[str, str] = field(default_factory=dict)  # instance_id -> its repository's git bundle, if any
    task_images: dict[str, str] = field(default_factory=dict)  # instance_id -> its task image by digest

    @property
    def in_task_images(self) -> bool:
        """Tasks run in task images (docker launcher, AWS), not as local processes on a checkout."""
        return self.spec.backend.in_task_images

    @property
    def spec_hash(self) -> str:
        """Same run = the same spec as written and the same instances (not where the checkout happens to be)."""
        written = self.spec.source or json.loads(self.spec.model_dump_json())
        key = json.dumps({"spec": written, "instances": sorted(self.rows)}, sort_keys=True, default=str)
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def repo_bundle_name(repo: str) -> str:
    return repo.replace("/", "__") + ".bundle"


def make_plan(spec: Spec, spec_file: str = "spec.toml") -> Plan:
    problems: list[SpecProblem] = []
    rows: list[dict] = []
    try:
        rows = instances.read_rows(Path(spec.instances.dataset))
    except Exception as e:  # noqa: BLE001 - an unreadable file (any way) is a spec problem, not a crash
        problems.append(SpecProblem(path="instances.dataset", message=f"cannot read: {e}"))
    try:
        rows = instances.select(rows, spec.instances.ids, spec.instances.filter, spec.instances.slice)
    except ValueError as e:
        problems.append(SpecProblem(path="instances.ids", message=str(e)))
    if not rows and not problems:
        problems.append(SpecProblem(path="instances", message="selects no instances"))
    problems += [SpecProblem(path="instances.dataset", message=p) for p in instances.check_rows(rows)[:10]]
    bundles: dict[str, str] = {}
    if spec.instances.repos is not None:
        for r in rows:
            bundle = Path(spec.instances.repos) / repo_bundle_name(r["repo"])
            if bundle.is_file():
                bundles[r["instance_id"]] = str(bundle)
    in_images = spec.backend.in_task_images
    # Without task images, the process launcher clones a bundle and the process grading backend grades in one: an
    # instance with neither cannot run here (real instances run in their task images: backend.launcher = "docker").
    needs_bundle = []
    if not in_images:
        needs_bundle.append(("backend.launcher", "the process launcher clones each instance's repository from a git bundle"))
    from eval_worker.graders import GRADERS

    if why := GRADERS.get(spec.eval.backend).needs_bundle:
        needs_bundle.append(("eval.backend", why))
    real = ("real SWE-bench instances run in their official images: backend.launcher = \"docker\" and "
            "eval.backend = \"docker\" (README: real instances)")
    for path, why in needs_bundle:
        missing = [r for r in rows if r["instance_id"] not in bundles]
        if missing and spec.instances.repos is None:
            problems.append(SpecProblem(path=path, message=f"instances.repos is not set: {why}; {real}"))
            continue
        for r in missing[:10]:
            problems.append(SpecProblem(path=path, message=(
                f"{r['instance_id']}: no repository (no {repo_bundle_name(r['repo'])} in {spec.instances.repos});"
                f" {why}; {real}")))
        if len(missing) > 10:
            problems.append(SpecProblem(path=path, message=f"... and {len(missing) - 10} more instance(s)"))
    sources = dict.fromkeys((r["instance_id"] for r in rows), task_shape.TESTBED) if in_images else dict(bundles)
    if problems:
        raise SpecError(spec_file, problems)
    refs = [
        AttemptRef(run=spec.run.name, instance_id=r["instance_id"], attempt=n)
        for r in rows
        for n in range(1, spec.run.attempts + 1)
    ]
    return Plan(spec=spec, rows={r["instance_id"]: r for r in rows}, repo_sources=sources, refs=refs, bundles=bundles)


def apply_validation(plan: Plan, conn, spec_file: str = "spec.toml") -> tuple[Plan, list[str]]:
    """eval.require_validated: keep, exclude (with a warning each) or refuse instances whose image has no valid
    gold validation record (eval_worker's image_validations)."""
    policy = plan.spec.eval.require_validated
    if policy == "off":
        return plan, []
    from eval_worker.records import validated

    records = validated(conn, list(plan.rows.values()), backend=None)
    bad = {iid: ("never validated" if rec is None else f"invalid: {rec.reason}")
           for iid, rec in records.items() if rec is None or not rec.valid}
    if not bad:
        return plan, []
    lines = [f"{iid} ({plan.rows[iid]['image']}): {why}" for iid, why in sorted(bad.items())]
    if policy == "refuse" or len(bad) == len(plan.rows):
        raise SpecError(spec_file, [SpecProblem(
            path="eval.require_validated",
            message=f"{len(bad)} instance image(s) without a valid gold validation: " + "; ".join(lines[:10]),
        )])
    rows = {k: v for k, v in plan.rows.items() if k not in bad}
    kept = Plan(spec=plan.spec, rows=rows, repo_sources={k: v for k, v in plan.repo_sources.items() if k in rows},
                refs=[r for r in plan.refs if r.instance_id in rows],
                bundles={k: v for k, v in plan.bundles.items() if k in rows},
                task_images={k: v for k, v in plan.task_images.items() if k in rows})
    return kept, [f"excluded {line}" for line in lines]
