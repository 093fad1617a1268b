"""Grade one patch the way swebench.harness.run_evaluation.run_instance does, with a grader
(eval_worker.graders: the process grader or the docker grader, which runs run_instance itself).

Grading itself is swebench's own get_eval_report (include_tests_status=True).

Outcomes (contract EvalOutcome), on every grader:
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

from pathlib import Path

from contract.models import EvalJob, Verdict
from eval_worker.graders import Grader, resolve_grader

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


def grade(job: EvalJob, patch: str, logs_root: str | Path, grader: str | Grader | None = None) -> Verdict:
    """Grade `patch` for `job` with `grader` (a Grader, or its name in eval_worker.graders.GRADERS; default
    process), writing the official per-instance files under logs_root.

    Idempotent: the instance's log directory is recreated, so grading the same (run, instance,
    attempt) again gives the same verdict and files. An empty patch is never graded (ValueError).
    """
    if patch is None or not patch.strip():
        raise ValueError(f"{job.ref.slug}: empty patch; empty patches are never graded")
    return resolve_grader(grader).grade(job, patch, logs_root)
