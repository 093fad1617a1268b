"""The official log layout (swebench 5.x run_evaluation / reporting), and where attempts go.

    <logs_root>/logs/run_evaluation/<run_id>/<model_name_or_path with "/" -> "__">/<instance_id>/
        patch.diff  eval.sh  test_output.txt  report.json  run_instance.log

Attempts: the attempt number goes into the *run_id*. Attempt 1 uses the run name unchanged, so a
normal single-attempt run is exactly the official layout for run_id=<run>; attempt n > 1 uses
run_id "<run>.attempt-<n>". Each attempt index therefore forms a complete official run of its own,
and swebench.harness.reporting.make_run_report (which looks for
RUN_EVALUATION_LOG_DIR/<run_id>/<model>/<iid>/report.json) works per attempt index unchanged;
the model directory stays the plain model_name_or_path, so the summary file keeps the official
name <model>.<run_id>.json.
"""

from __future__ import annotations

from pathlib import Path

from swebench.harness.constants import RUN_EVALUATION_LOG_DIR

LOG_FILES = ("patch.diff", "eval.sh", "test_output.txt", "report.json", "run_instance.log")
# beside them when a grading without valid test output was checked against the untouched base
BASE_TEST_OUTPUT = "base_test_output.txt"
BASE_LOG_INSTANCE = "base_run_instance.log"
UPLOADED_FILES = (*LOG_FILES, BASE_TEST_OUTPUT, BASE_LOG_INSTANCE)
EMPTY_MODEL = "empty"  # gold validation's untouched-base run: its model directory in the official layout


def official_run_id(run: str, attempt: int = 1) -> str:
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return run if attempt == 1 else f"{run}.attempt-{attempt}"


def model_dir_name(model_name_or_path: str) -> str:
    return model_name_or_path.replace("/", "__")


def instance_log_dir(
    logs_root: str | Path, run: str, attempt: int, model_name_or_path: str, instance_id: str
) -> Path:
    return (
        Path(logs_root)
        / RUN_EVALUATION_LOG_DIR
        / official_run_id(run, attempt)
        / model_dir_name(model_name_or_path)
        / instance_id
    )
