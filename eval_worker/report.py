"""Run summaries with swebench's own make_run_report (client=None), over the official layout.

make_run_report looks for RUN_EVALUATION_LOG_DIR/<run_id>/<model with "/" -> "__">/<iid>/report.json,
relative to the current directory; write_run_report runs it from logs_root (see eval_worker.layout:
attempt n > 1 is the official run "<run>.attempt-<n>").

One deliberate difference: make_run_report counts a report.json as completed and, unless resolved,
unresolved; its infra_failure_ids only echo log signatures. An instance whose report entry has
infra_failure set (our graders set it only when the failure is established, e.g. environment_broken:
no valid test output with the patch nor on the untouched base) is not the model's: apply_infra_entries
moves it from unresolved_ids/error_ids to infra_failure_ids, with its reason in failure_reasons.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from swebench.harness.reporting import make_run_report

from eval_worker.cwd import in_directory
from eval_worker.layout import official_run_id


def _predictions_by_id(predictions) -> dict[str, dict]:
    if isinstance(predictions, (str, Path)):
        from swebench.harness.utils import get_predictions_from_file

        predictions = get_predictions_from_file(str(predictions), "", "")
    if isinstance(predictions, Mapping):
        items = list(predictions.values())
    else:
        items = list(predictions)
    out = {}
    for p in items:
        if "instance_id" not in p or "model_name_or_path" not in p:
            raise ValueError(f"prediction without instance_id/model_name_or_path: {p!r}")
        out[p["instance_id"]] = dict(p)
    return out


def _dataset(dataset) -> list[dict]:
    if isinstance(dataset, (str, Path)):
        from swebench.harness.utils import load_swebench_dataset

        return list(load_swebench_dataset(str(dataset), "test"))
    return list(dataset)


def count_infra_failures(report: dict, infra: Mapping[str, str]) -> dict:
    """The run report with the instances in `infra` ({instance_id: reason}) counted as infrastructure failures
    (infra_failure_ids, failure_reasons) and taken out of every id list that scores the model (resolved,
    unresolved, empty patch, error, ambiguous); every count follows. completed_ids stays make_run_report's."""
    out = dict(report)
    if not infra:
        return out
    for key in ("resolved", "unresolved", "empty_patch", "error", "ambiguous_failure"):
        out[f"{key}_ids"] = sorted(set(report.get(f"{key}_ids", [])) - set(infra))
        out[f"{key}_instances"] = len(out[f"{key}_ids"])
    out["infra_failure_ids"] = sorted(set(report.get("infra_failure_ids", [])) | set(infra))
    out["infra_failure_instances"] = len(out["infra_failure_ids"])
    out["failure_reasons"] = dict(sorted({**report.get("failure_reasons", {}), **infra}.items()))
    return out


def apply_infra_entries(report: dict, entries: Mapping[str, dict]) -> dict:
    """count_infra_failures for every graded instance whose report entry has infra_failure set (our graders set it
    only when the failure is established, e.g. environment_broken)."""
    graded = set(report["submitted_ids"]) - set(report["empty_patch_ids"])
    return count_infra_failures(report, {iid: e.get("infra_failure_reason") or "infra_failure"
                                         for iid, e in entries.items() if e and e.get("infra_failure") and iid in graded})


def _report_entries(logs_root: Path, run_id: str, preds: dict[str, dict]) -> dict[str, dict]:
    from swebench.harness.constants import LOG_REPORT, RUN_EVALUATION_LOG_DIR

    entries = {}
    for iid, p in preds.items():
        f = logs_root / RUN_EVALUATION_LOG_DIR / run_id / p["model_name_or_path"].replace("/", "__") / iid / LOG_REPORT
        try:
            entries[iid] = json.loads(f.read_text())[iid]
        except (OSError, ValueError, KeyError):
            continue
    return entries


def write_run_report(
    predictions: Mapping[str, dict] | Iterable[dict] | str | Path,
    dataset: Iterable[dict] | str | Path,
    run: str,
    logs_root: str | Path,
    *,
    attempt: int = 1,
    report_dir: str | Path | None = None,
    quiet: bool = True,
) -> Path:
    """Write <report_dir>/<model with "/" -> "__">.<run_id>.json (official keys: resolved_ids,
    unresolved_ids, empty_patch_ids, error_ids, ...) and return its path.

    predictions: {iid: {"instance_id", "model_name_or_path", "model_patch"}}, a list of those, or a
    predictions file; dataset: instance rows or a .json/.jsonl/.parquet path. report_dir defaults to
    logs_root. run_id is official_run_id(run, attempt). Established infrastructure failures are counted
    as such (apply_infra_entries).
    """
    preds = _predictions_by_id(predictions)
    if not preds:
        raise ValueError("no predictions")
    rows = _dataset(dataset)
    logs_root = Path(logs_root).resolve()
    out_dir = Path(report_dir).resolve() if report_dir else logs_root
    run_id = official_run_id(run, attempt)
    with in_directory(logs_root):
        sink = io.StringIO() if quiet else None
        with contextlib.redirect_stdout(sink) if sink else contextlib.nullcontext():
            path = make_run_report(preds, rows, run_id, client=None, report_dir=str(out_dir))
    path = (out_dir / Path(path).name).resolve()
    report = apply_infra_entries(read_run_report(path), _report_entries(logs_root, run_id, preds))
    path.write_text(json.dumps(report, indent=4) + "\n")
    return path


def read_run_report(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
