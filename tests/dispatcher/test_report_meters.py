"""A run through the gateway whose meters disagree is flagged where its results are read: the results table's
caption and the official report's extra key `meters`; one whose meters agree says so; a run without the gateway
gets neither (it has one meter)."""

from __future__ import annotations

import json

from rich.console import Console

from contract import aws
from contract.models import Totals
from dispatcher.report import results_table, write_outputs
from dispatcher.report.reconcile import Difference, Reconciliation
from tests.dispatcher.test_report_tamper import attempt


def meters(run: str, differences: list[Difference], gateway_calls: int = 2) -> Reconciliation:
    return Reconciliation(run=run, shim=Totals(calls=2, cost_usd=0.002), gateway=Totals(calls=gateway_calls,
                          cost_usd=0.001 * gateway_calls), differences=differences)


def test_disagreeing_meters_are_flagged_in_the_table_and_the_official_report(moto_endpoint, unique, tmp_path):
    aws.client("s3").create_bucket(Bucket=unique)

    def prefix(iid: str, n: int) -> str:
        return f"s3://{unique}/runs/{unique}/attempts/{iid}/{n}/"

    aws.put_text(prefix("x__y-1", 1) + "patch.diff", "diff --git a/x b/x\n")
    dataset = [{"instance_id": "x__y-1", "repo": "x/y", "version": "1.0"}]
    attempts = [attempt("x__y-1", "RESOLVED", True, prefix("x__y-1", 1) + "patch.diff", None)]
    off = meters(unique, [Difference(shim_call_id="c1", gateway_call_id=None, what="no gateway call id on the shim"
                                                                                    " row")], gateway_calls=1)
    cases = {"off": off, "agree": meters(unique, []), "none": None,
             "no gateway": Reconciliation(run=unique, shim=Totals(calls=2), gateway=Totals(), differences=[])}
    reports, captions = {}, {}
    for name, m in cases.items():
        _, report = write_outputs(unique, attempts, dataset, tmp_path / name.replace(" ", "-"), 1, prefix, m)
        reports[name] = json.loads(report.read_text())
        console = Console(record=True, width=240)
        console.print(results_table(unique, attempts, m))
        captions[name] = console.export_text()

    assert reports["off"]["meters"] == {"agree": False, "differences": 1, "shim": off.shim.model_dump(),
                                        "gateway": off.gateway.model_dump(), "provider": None,
                                        "provider_counts_calls": True}
    assert "METERS DISAGREE: 1 differences" in captions["off"] and f"report {unique}" in captions["off"]
    assert reports["agree"]["meters"]["agree"] is True and reports["agree"]["meters"]["differences"] == 0
    assert "meters (shim, gateway) agree" in captions["agree"]
    for name in ("none", "no gateway"):
        assert "meters" not in reports[name] and "meters" not in captions[name].lower()
    # every official key as make_run_report wrote it
    assert {k: v for k, v in reports["off"].items() if k != "meters"} == reports["none"]
