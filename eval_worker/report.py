"""Run summaries with swebench's own make_run_report (client=None), over the official layout.

make_run_report looks for RUN_EVALUATION_LOG_DIR/<run_id>/<model with "/" -> "__">/<iid>/report.json,
relative to the current directory; write_run_report runs it from logs_root (see eval_worker.layout:
attempt n > 1 is the official run "<run>.attempt-<n>").
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
    logs_root. run_id is official_run_id(run, attempt).
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
    return (out_dir / Path(path).name).resolve()


def read_run_report(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
