"""Gold validation of instance images: is this image a fair place to grade this instance?

Valid iff, on exactly this image (by digest): the gold patch resolves (graded like any patch, through
the official run_instance on the docker backend), and the eval script run on the untouched base
(run_instance's skip_patch mode; an empty patch itself is never graded) leaves every FAIL_TO_PASS test
failing. The result is recorded per (instance, digest) in image_validations; infrastructure failures
(daemon down, image missing) are not recorded: they say nothing about the image. An image whose
environment cannot run the tests (gold graded infra_error, reason environment_broken) is recorded as
invalid: that is a finding about the image.

The dispatcher asks `validated(conn, instance_rows)` (re-exported from eval_worker.records).
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

from contract.models import AttemptRef, EvalJob, EvalOutcome, Verdict
from eval_worker.graders import Grader, GradingSandboxError, resolve_grader
from eval_worker.grading import ENVIRONMENT_BROKEN, grade
from eval_worker.images import repo_bundle
from eval_worker.records import ValidationRecord, record_validation, validated

log = logging.getLogger("eval_worker.validation")

GOLD_MODEL = "gold"


class ValidationInfraError(RuntimeError):
    """Validation could not run (infrastructure); nothing is recorded."""


def _job(row: dict, run: str, model: str, repo_source: str, timeout_s: float) -> EvalJob:
    return EvalJob(
        ref=AttemptRef(run=run, instance_id=row["instance_id"], attempt=1), model_name=model,
        patch_uri="validation:gold", instance=row, repo_source=repo_source,
        verdict_queue_url="validation:none", artifacts_prefix="validation:none", timeout_s=timeout_s,
    )


def _verdict_details(v: Verdict) -> dict:
    return {"outcome": v.outcome.value, "reason": v.reason, "report": v.report}


def _raise_on_infra(iid: str, gold: Verdict) -> None:
    """An infrastructure failure says nothing about the image, except that its environment cannot run the
    tests (environment_broken): that one is judged (invalid)."""
    if gold.outcome is EvalOutcome.INFRA_ERROR and gold.report.get("infra_failure_reason") != ENVIRONMENT_BROKEN:
        raise ValidationInfraError(f"{iid}: gold run: {gold.reason}")


def judge(gold: Verdict, base_entry: dict | None, f2p: list[str]) -> tuple[bool, str | None]:
    """(valid, reason): gold must resolve; on the base, every FAIL_TO_PASS test must fail."""
    if not gold.resolved:
        return False, f"gold patch did not resolve: {gold.outcome.value}" + (f" ({gold.reason})" if gold.reason else "")
    if base_entry is None:
        return False, "untouched base: no report (eval script timed out or failed)"
    if not base_entry.get("patch_successfully_applied"):
        return False, "untouched base: no valid test output"
    passing = [t for t in f2p if t in base_entry["tests_status"]["FAIL_TO_PASS"]["success"]]
    if passing:
        return False, f"untouched base: FAIL_TO_PASS tests already pass: {passing}"
    if base_entry["resolved"]:
        return False, "untouched base resolves the instance"
    return True, None


def validate_instance(
    row: dict,
    *,
    grader: str | Grader = "docker",
    repos_dir: str | Path | None = None,
    logs_root: str | Path,
    run: str | None = None,
    timeout_s: float = 1800.0,
) -> ValidationRecord:
    """Validate one instance with `grader` (a Grader, or its name in eval_worker.graders.GRADERS); raises
    ValidationInfraError when the check itself could not run."""
    grader = resolve_grader(grader)
    iid = row["instance_id"]
    run = run or f"validate-{uuid.uuid4().hex[:8]}"
    logs_root = Path(logs_root)
    f2p = json.loads(row["FAIL_TO_PASS"]) if isinstance(row["FAIL_TO_PASS"], str) else list(row["FAIL_TO_PASS"])
    repo_source = str(repo_bundle(row, repos_dir)) if repos_dir else ""
    try:
        subject = grader.validation_subject(row, repo_source)
    except GradingSandboxError as e:
        raise ValidationInfraError(f"{iid}: {e}") from e
    gold = grade(_job(subject.row, run, GOLD_MODEL, repo_source, timeout_s), row["patch"], logs_root, grader)
    _raise_on_infra(iid, gold)
    try:
        base = grader.base_report(subject.row, repo_source, run, logs_root, timeout_s)
    except GradingSandboxError as e:
        raise ValidationInfraError(f"{iid}: base run: {e}") from e
    valid, reason = judge(gold, base, f2p)
    return ValidationRecord(
        image=row["image"], digest=subject.digest, instance_id=iid, backend=grader.name, valid=valid, reason=reason,
        details={"run": run, "gold": _verdict_details(gold), "base": base},
    )


def validate(
    rows: list[dict], conn, *, grader: str | Grader = "docker", repos_dir: str | Path | None = None,
    logs_root: str | Path, timeout_s: float = 1800.0,
) -> tuple[list[ValidationRecord], list[str]]:
    """Validate and record every row with `grader` (one grader for them all). Returns (records written,
    infrastructure errors)."""
    grader = resolve_grader(grader)
    run = f"validate-{uuid.uuid4().hex[:8]}"
    done, errors = [], []
    for row in rows:
        try:
            rec = validate_instance(row, grader=grader, repos_dir=repos_dir, logs_root=logs_root, run=run,
                                    timeout_s=timeout_s)
        except ValidationInfraError as e:
            log.error("not validated: %s", e)
            errors.append(str(e))
            continue
        record_validation(conn, rec)
        done.append(rec)
        log.info("%s on %s: %s%s", rec.instance_id, rec.digest, "valid" if rec.valid else "INVALID",
                 f" ({rec.reason})" if rec.reason else "")
    return done, errors


__all__ = ["ValidationInfraError", "ValidationRecord", "judge", "validate", "validate_instance", "validated"]
