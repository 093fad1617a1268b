"""A run's results and reports.

outputs.py: the results table, predictions.jsonl and the official SWE-bench run report (make_run_report, with
infrastructure failures moved to infra_failure_ids, and our extra keys: tamper flags, the meters' agreement).
reconcile.py: the shim's, the gateway's and the provider's meters side by side. analytics.py with figures.py,
stats.py, plots.py and html.py: a run's figures from its rows and ledger, pass@k, bootstrap intervals, the paired
comparison and McNemar's test, the PNGs and the one self-contained HTML file (`python -m dispatcher report RUN
[--compare RUN_B]`).
"""

from dispatcher.report.outputs import (
    STATUS_ORDER,
    fetch_attempts,
    infra_reason,
    mark_infra_failures,
    official_run_id,
    print_results,
    results_table,
    write_outputs,
)

__all__ = ["STATUS_ORDER", "fetch_attempts", "infra_reason", "mark_infra_failures", "official_run_id",
           "print_results", "results_table", "write_outputs"]
