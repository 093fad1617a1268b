"""A run's results and reports.

official.py: the results table, predictions.jsonl and the official SWE-bench run report (make_run_report, with
infrastructure failures moved to infra_failure_ids). figures.py: a run's figures from its rows and ledger;
stats.py: pass@k, bootstrap intervals, the paired comparison and McNemar's test; plots.py and html.py: the PNGs
and the one self-contained HTML file (`python -m dispatcher report RUN [--compare RUN_B]`).
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
