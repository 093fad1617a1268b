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

import hashlib
import json
import logging
import sys
import uuid
from pathlib import Path

import docker
from swebench.harness.constants import LOG_TEST_OUTPUT
from swebench.harness.grading import get_eval_report
from swebench.harness.utils import make_test_spec

from contract.models import AttemptRef, EvalJob, EvalOutcome, Verdict
from eval_worker.docker_backend import DockerBackend
from eval_worker.grading import ENVIRONMENT_BROKEN, grade, run_on_base, timeout_text
from eval_worker.images import repo_bundle
from eval_worker.layout import instance_log_dir
from eval_worker.pinning import ImageUnavailable
from eval_worker.records import ValidationRecord, record_validation, validated
from eval_worker.sandbox import ProcessBackend, SandboxError

log = logging.getLogger("eval_worker.validation")

GOLD_MODEL = "gold"
EMPTY_MODEL = "empty"  # the untouched-base run's model directory in the official layout


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


def _base_run_docker(backend: DockerBackend, row: dict, ref: str, run: str, logs_root: Path,
                     timeout_s: float) -> dict | None:
    """The eval script on the untouched base image via run_instance(skip_patch=True): report entry."""
    ts = make_test_spec({**row, "image": ref})
    pred = {"instance_id": row["instance_id"], "model_name_or_path": EMPTY_MODEL, "model_patch": ""}
    result = backend.run_official(ts, pred, run, logs_root, timeout_s, skip_patch=True)
    return result[1][row["instance_id"]] if result else None


def _base_run_process(backend: ProcessBackend, row: dict, repo_source: str, run: str, logs_root: Path,
                      timeout_s: float) -> dict | None:
    """The eval script on an untouched checkout, graded with the official get_eval_report."""
    iid = row["instance_id"]
    ts = make_test_spec(row)
    log_dir = instance_log_dir(logs_root, run, 1, EMPTY_MODEL, iid)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "eval.sh").write_text(ts.eval_script)
    out = log_dir / LOG_TEST_OUTPUT
    run_on_base(backend, row, repo_source, out, timeout_s)
    if out.read_text(errors="replace").endswith(timeout_text(timeout_s)):
        return None
    pred = {"instance_id": iid, "model_name_or_path": EMPTY_MODEL, "model_patch": ""}
    return get_eval_report(ts, pred, str(out), include_tests_status=True)[iid]


def process_digest(backend: ProcessBackend, row: dict, repo_source: str) -> str:
    """What the process backend grades on: the repository source, the base commit and the environment
    (its recipe, interpreter and layout; without a recipe, the worker's Python and pytest)."""
    import importlib.metadata

    h = hashlib.sha256()
    src = Path(repo_source)
    h.update(src.read_bytes() if src.is_file() else repo_source.encode())
    env = backend.environment(row, repo_source)
    where = env.path.name if env else f"{sys.version}|pytest {importlib.metadata.version('pytest')}"
    h.update(f"{row['base_commit']}|{where}".encode())
    return f"process:sha256:{h.hexdigest()}"


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
    backend: str = "docker",
    docker_backend: DockerBackend | None = None,
    repos_dir: str | Path | None = None,
    logs_root: str | Path,
    run: str | None = None,
    timeout_s: float = 1800.0,
    process_backend: ProcessBackend | None = None,
) -> ValidationRecord:
    """Validate one instance; raises ValidationInfraError when the check itself could not run."""
    iid = row["instance_id"]
    run = run or f"validate-{uuid.uuid4().hex[:8]}"
    logs_root = Path(logs_root)
    f2p = json.loads(row["FAIL_TO_PASS"]) if isinstance(row["FAIL_TO_PASS"], str) else list(row["FAIL_TO_PASS"])
    repo_source = str(repo_bundle(row, repos_dir)) if repos_dir else ""
    if backend == "docker":
        db = docker_backend or DockerBackend()
        try:
            pinned = db.pin(row)
        except ImageUnavailable as e:
            raise ValidationInfraError(f"{iid}: {e}") from e
        try:
            try:
                digest = db.client.images.get(pinned.ref).id
            except docker.errors.ImageNotFound:
                digest = db.client.images.pull(pinned.ref).id  # a mirror reference: by digest
        except docker.errors.DockerException as e:
            raise ValidationInfraError(f"{iid}: {pinned.ref}: {e}") from e
        row_pinned = {**row, "image": pinned.ref}
        gold = grade(_job(row_pinned, run, GOLD_MODEL, repo_source, timeout_s), row["patch"], logs_root, db)
        _raise_on_infra(iid, gold)
        base = _base_run_docker(db, row, pinned.ref, run, logs_root, timeout_s)
    elif backend == "process":
        if not repos_dir:
            raise ValueError("the process backend needs repos_dir")
        pb = process_backend or ProcessBackend()
        try:
            digest = process_digest(pb, row, repo_source)
        except SandboxError as e:
            raise ValidationInfraError(f"{iid}: {e}") from e
        gold = grade(_job(row, run, GOLD_MODEL, repo_source, timeout_s), row["patch"], logs_root, pb)
        _raise_on_infra(iid, gold)
        try:
            base = _base_run_process(pb, row, repo_source, run, logs_root, timeout_s)
        except SandboxError as e:
            raise ValidationInfraError(f"{iid}: base run: {e}") from e
    else:
        raise ValueError(f"unknown backend {backend!r}")
    valid, reason = judge(gold, base, f2p)
    return ValidationRecord(
        image=row["image"], digest=digest, instance_id=iid, backend=backend, valid=valid, reason=reason,
        details={"run": run, "gold": _verdict_details(gold), "base": base},
    )


def validate(
    rows: list[dict], conn, *, backend: str = "docker", docker_backend: DockerBackend | None = None,
    repos_dir: str | Path | None = None, logs_root: str | Path, timeout_s: float = 1800.0,
    process_backend: ProcessBackend | None = None,
) -> tuple[list[ValidationRecord], list[str]]:
    """Validate and record every row. Returns (records written, infrastructure errors)."""
    run = f"validate-{uuid.uuid4().hex[:8]}"
    done, errors = [], []
    for row in rows:
        try:
            rec = validate_instance(row, backend=backend, docker_backend=docker_backend, repos_dir=repos_dir,
                                    logs_root=logs_root, run=run, timeout_s=timeout_s,
                                    process_backend=process_backend)
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
