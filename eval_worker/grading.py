"""Grade one patch the way swebench.harness.run_evaluation.run_instance does, on a GradingBackend.

The steps, files and markers follow run_instance (swebench 5.0.2); only the container calls go through
the backend. Grading itself is swebench's own get_eval_report (include_tests_status=True).

Outcomes (contract EvalOutcome):
  resolved / unresolved   report.json written, from get_eval_report
  error                   report.json written, but no valid test output (patch_successfully_applied False),
                          while the same eval script on the untouched base does give valid test output:
                          the patch broke the test run
  apply_failed            every GIT_APPLY_CMDS try failed: ">>>>> Patch Apply Failed" in run_instance.log,
                          no test run, no report.json (official: counted in error_ids)
  timeout                 test_output.txt ends with the official "Timeout error: N seconds exceeded.",
                          no report.json (official: counted in error_ids)
  infra_error             the sandbox could not be prepared or used (clone failure, no environment, ...),
                          the instance row is unusable, or the environment cannot run the tests: no valid
                          test output with the patch AND none on the untouched base (reason
                          environment_broken; report.json then carries the infra fields); never a model
                          failure

The base check (check_environment) runs only when a completed eval script gave no valid test output
(swebench's get_logs_eval found nothing: markers missing, nothing parseable, or a failing exit code with
no failing test); apply failures and timeouts are the patch's as in the official harness. Its files are
base_test_output.txt (and, on docker, base_run_instance.log) beside the official ones.
"""

from __future__ import annotations

import json
import logging
import shutil
import traceback
from pathlib import Path

from swebench.harness.constants import (
    APPLY_PATCH_FAIL,
    APPLY_PATCH_PASS,
    CONTAINER_PATCH_FILE,
    LOG_INSTANCE,
    LOG_REPORT,
    LOG_TEST_OUTPUT,
)
from swebench.harness.grading import get_eval_report, get_logs_eval
from swebench.harness.run_evaluation import GIT_APPLY_CMDS
from swebench.harness.utils import make_test_spec

from contract.models import EvalJob, EvalOutcome, Verdict, utcnow
from eval_worker.layout import BASE_TEST_OUTPUT, instance_log_dir
from eval_worker.sandbox import GradingBackend, ProcessBackend, Sandbox, SandboxError

RESET_CMD = "git checkout -- . ; git clean -fd"
ENVIRONMENT_BROKEN = "environment_broken"


def timeout_text(timeout: float) -> str:
    t = str(int(timeout)) if float(timeout).is_integer() else str(timeout)
    return f"\n\nTimeout error: {t} seconds exceeded."


def infra_entry(reason: str) -> dict:
    """The official report keys for a grading that produced no test output for infrastructure reasons
    (v5 infra-failure fields set), so infra verdicts carry the same shape as graded ones."""
    return {
        "patch_is_None": False, "patch_exists": True, "patch_successfully_applied": False,
        "resolved": False, "infra_failure": True, "infra_failure_reason": reason,
    }


def environment_broken(entry: dict) -> dict:
    """The official report entry of a grading whose environment cannot run the tests: infra fields set,
    the tests' statuses (if any) kept."""
    return {**entry, **infra_entry(ENVIRONMENT_BROKEN)}


ENVIRONMENT_BROKEN_REASON = ("environment_broken: no valid test output with the patch, and none from the same "
                             "eval script on the untouched base")


def run_on_base(backend: GradingBackend, instance: dict, repo_source: str, out_path: Path,
                timeout_s: float) -> bool:
    """The eval script on the untouched base commit, in a fresh sandbox of the same environment; its output
    (merged, with the official timeout line) goes to out_path. True iff it gave valid test output."""
    test_spec = make_test_spec(instance)
    sandbox = backend.create(instance=instance, repo_source=repo_source)
    try:
        sandbox.put_file("/eval.sh", test_spec.eval_script)
        res = sandbox.exec("/bin/bash /eval.sh", timeout=timeout_s)
    finally:
        sandbox.close()
    out_path.write_text(res.output + (timeout_text(timeout_s) if res.timed_out else ""))
    return not res.timed_out and get_logs_eval(test_spec, str(out_path))[1]


def _instance_logger(log_file: Path) -> logging.Logger:
    """Like swebench.logger.setup_logger, but unique per log file (attempts may grade concurrently)."""
    logger = logging.getLogger(f"eval_worker.instance.{log_file}")
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    handler = logging.FileHandler(log_file, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def _close_logger(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()


def apply_patch(sandbox: Sandbox, logger: logging.Logger) -> tuple[bool, str]:
    """The official apply chain: GIT_APPLY_CMDS in order, resetting between tries, then the
    "already applied" reverse check. Returns (applied, output of the last try)."""
    output = ""
    for attempt, git_apply_cmd in enumerate(GIT_APPLY_CMDS):
        if attempt:
            sandbox.exec(RESET_CMD)
        res = sandbox.exec(f"{git_apply_cmd} {CONTAINER_PATCH_FILE}")
        output = res.output
        if res.exit_code == 0:
            logger.info(f"{APPLY_PATCH_PASS}:\n{res.output}")
            return True, output
        logger.info(f"Failed to apply patch to container: {git_apply_cmd}")
    reverse = sandbox.exec(f"git apply --check --reverse {CONTAINER_PATCH_FILE}")
    if reverse.exit_code == 0:
        logger.info(f"{APPLY_PATCH_PASS}: verified already applied")
        return True, output
    return False, output


def grade(job: EvalJob, patch: str, logs_root: str | Path, backend: GradingBackend | None = None) -> Verdict:
    """Grade `patch` for `job`, writing the official per-instance files under logs_root.

    Idempotent: the instance's log directory is recreated, so grading the same (run, instance,
    attempt) again gives the same verdict and files. An empty patch is never graded (ValueError).
    """
    if patch is None or not patch.strip():
        raise ValueError(f"{job.ref.slug}: empty patch; empty patches are never graded")
    backend = backend or ProcessBackend()
    if callable(getattr(backend, "grade", None)):  # a backend that runs the official harness itself
        return backend.grade(job, patch, logs_root)
    started = utcnow()
    iid = job.ref.instance_id
    log_dir = instance_log_dir(logs_root, job.ref.run, job.ref.attempt, job.model_name, iid)
    if log_dir.exists():
        shutil.rmtree(log_dir)
    log_dir.mkdir(parents=True)
    logger = _instance_logger(log_dir / LOG_INSTANCE)
    pred = {"instance_id": iid, "model_name_or_path": job.model_name, "model_patch": patch}

    def verdict(outcome: EvalOutcome, report: dict | None = None, reason: str | None = None) -> Verdict:
        entry = (report or {}).get(iid, {})
        return Verdict(
            ref=job.ref,
            outcome=outcome,
            resolved=outcome is EvalOutcome.RESOLVED,
            report=entry,
            reason=reason,
            started_at=started,
            ended_at=utcnow(),
        )

    sandbox: Sandbox | None = None
    try:
        (log_dir / "patch.diff").write_text(patch)
        try:
            if job.instance.get("instance_id") != iid:
                row_iid = job.instance.get("instance_id")
                raise ValueError(f"instance row is for {row_iid!r}, job is for {iid!r}")
            test_spec = make_test_spec(job.instance)
            base_commit = job.instance["base_commit"]
        except (KeyError, ValueError, TypeError) as e:
            logger.error(f"Unusable instance row: {e!r}")
            return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry("bad_instance_row")},
                           reason=f"bad instance row: {e!r}")

        logger.info(f"Creating sandbox ({getattr(backend, 'name', type(backend).__name__)}) for {iid}...")
        try:
            sandbox = backend.create(instance=job.instance, repo_source=job.repo_source)
        except SandboxError as e:
            logger.error(f"Error creating sandbox for {iid}: {e}")
            return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry(e.reason)}, reason=f"sandbox: {e}")
        logger.info(f"Sandbox for {iid} ready at base commit {base_commit}")

        logger.info(
            f"Intermediate patch for {iid} written to {log_dir / 'patch.diff'}, now applying to container..."
        )
        sandbox.put_file(CONTAINER_PATCH_FILE, patch)
        applied, apply_output = apply_patch(sandbox, logger)
        if not applied:
            logger.info(f"{APPLY_PATCH_FAIL}:\n{apply_output}")
            # official: EvaluationError, no report.json; the verdict still carries the official report
            # entry computed by get_eval_report from this log (which holds the marker).
            report = get_eval_report(test_spec, pred, str(log_dir / LOG_INSTANCE), include_tests_status=True)
            return verdict(EvalOutcome.APPLY_FAILED, report, reason=APPLY_PATCH_FAIL)

        diff_before = sandbox.exec("git -c core.fileMode=false diff").output.strip()
        logger.info(f"Git diff before:\n{diff_before}")

        eval_script = test_spec.eval_script
        (log_dir / "eval.sh").write_text(eval_script)
        logger.info(f"Eval script for {iid} written to {log_dir / 'eval.sh'}; copying to container...")
        sandbox.put_file("/eval.sh", eval_script)

        res = sandbox.exec("/bin/bash /eval.sh", timeout=job.timeout_s)
        test_output_path = log_dir / LOG_TEST_OUTPUT
        logger.info(f"Test runtime: {res.runtime_s:_.2f} seconds")
        with open(test_output_path, "w") as f:
            f.write(res.output)
            logger.info(f"Test output for {iid} written to {test_output_path}")
            if res.timed_out:
                f.write(timeout_text(job.timeout_s))
        if res.timed_out:
            logger.info(f"Test timed out after {job.timeout_s} seconds; process group {res.pgid} killed.")
            return verdict(EvalOutcome.TIMEOUT, reason=f"tests timed out after {job.timeout_s} s")

        diff_after = sandbox.exec("git -c core.fileMode=false diff").output.strip()
        logger.info(f"Git diff after:\n{diff_after}")
        if diff_after != diff_before:
            logger.info("Git diff changed after running eval script")

        logger.info(f"Grading answer for {iid}...")
        report = get_eval_report(test_spec, pred, str(test_output_path), include_tests_status=True)
        entry = report[iid]
        logger.info(f"report: {report}\nResult for {iid}: resolved: {entry['resolved']}")
        (log_dir / LOG_REPORT).write_text(json.dumps(report, indent=4))
        if entry["resolved"]:
            return verdict(EvalOutcome.RESOLVED, report)
        if not entry["patch_successfully_applied"]:
            sandbox.close()  # releases the environment for the base run
            logger.info("No valid test output: running the eval script on the untouched base...")
            if not run_on_base(backend, job.instance, job.repo_source, log_dir / BASE_TEST_OUTPUT, job.timeout_s):
                logger.info(f"No valid test output on the base either: {ENVIRONMENT_BROKEN}")
                entry = environment_broken(entry)
                (log_dir / LOG_REPORT).write_text(json.dumps({iid: entry}, indent=4))
                return verdict(EvalOutcome.INFRA_ERROR, {iid: entry}, reason=ENVIRONMENT_BROKEN_REASON)
            logger.info("The base gives valid test output: the patch broke the test run")
            reason = "no valid test output"
            if entry.get("infra_failure_reason"):
                reason += f" ({entry['infra_failure_reason']})"
            return verdict(EvalOutcome.ERROR, report, reason=reason)
        return verdict(EvalOutcome.UNRESOLVED, report)
    except SandboxError as e:
        logger.error(f"Sandbox error for {iid}: {e}\n{traceback.format_exc()}")
        return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry(e.reason)}, reason=f"sandbox: {e}")
    except OSError as e:
        logger.error(f"I/O error for {iid}: {e}\n{traceback.format_exc()}")
        return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry("io_error")}, reason=f"io: {e}")
    finally:
        if sandbox is not None:
            sandbox.close()
        _close_logger(logger)
