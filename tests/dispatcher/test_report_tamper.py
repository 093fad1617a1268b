"""Tamper flags in `dispatcher report`: the results table names them, and the official run report JSON (swebench's
own make_run_report over the rows) gets one extra key, tamper_flags, every official key unchanged."""

from __future__ import annotations

import json

from rich.console import Console

from contract import aws
from dispatcher.report import results_table, write_outputs
from dispatcher.report.figures import compute_usd

FLAGS = [{"rule": "conftest", "files": ["conftest.py"]}, {"rule": "test_file", "files": ["tests/test_stats.py"]}]


def attempt(iid: str, status: str, resolved: bool, patch_uri: str, flags) -> dict:
    """An attempt row as the report's loader gives it (priced: compute_usd)."""
    row = {"instance_id": iid, "attempt": 1, "slot": 1, "superseded": False, "model": "gpt-4o-mini", "outcome": "submitted", "status": status,
            "patch_uri": patch_uri, "patch_bytes": 20, "calls": 1, "input_tokens": 10, "cached_tokens": 0,
            "cache_write_tokens": 0, "output_tokens": 5, "cost_usd": 0.001, "wall_time_s": 1.0,
            "eval_outcome": "resolved" if resolved else "unresolved", "error": None, "tamper_flags": flags,
            "report": {"patch_is_None": False, "patch_exists": True, "patch_successfully_applied": True,
                       "resolved": resolved, "tests_status": {}}}
    return row | {"compute_usd": compute_usd(row)}


def test_the_flags_are_shown_and_added_beside_the_official_keys(moto_endpoint, unique, tmp_path):
    aws.client("s3").create_bucket(Bucket=unique)

    def prefix(iid: str, n: int) -> str:
        return f"s3://{unique}/runs/{unique}/attempts/{iid}/{n}/"

    for iid in ("x__y-1", "x__y-2"):
        aws.put_text(prefix(iid, 1) + "patch.diff", "diff --git a/x b/x\n")
    dataset = [{"instance_id": i, "repo": "x/y", "version": "1.0"} for i in ("x__y-1", "x__y-2")]

    def official(flags, out):
        attempts = [attempt("x__y-1", "RESOLVED", True, prefix("x__y-1", 1) + "patch.diff", flags),
                    attempt("x__y-2", "UNRESOLVED", False, prefix("x__y-2", 1) + "patch.diff", None)]
        _, report = write_outputs(unique, attempts, dataset, out, 1, prefix)
        return attempts, json.loads(report.read_text())

    attempts, flagged = official(FLAGS, tmp_path / "a")
    _, plain = official(None, tmp_path / "b")
    assert flagged.pop("tamper_flags") == {"x__y-1": FLAGS} and plain.pop("tamper_flags") == {}
    assert flagged == plain  # the official keys, as make_run_report wrote them
    assert flagged["resolved_ids"] == ["x__y-1"] and flagged["unresolved_ids"] == ["x__y-2"]

    console = Console(record=True, width=240)
    console.print(results_table(unique, attempts))
    text = console.export_text()
    assert "conftest: conftest.py; test_file: tests/test_stats.py" in text and "1 flagged" in text
