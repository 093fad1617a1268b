"""evalplane eval worker: grades patches with swebench's own grading, on a GradingBackend.

Python API:
    eval_worker.grading.grade(job, patch, logs_root, backend=None) -> Verdict
    eval_worker.sandbox.GradingBackend (Protocol), ProcessBackend (no Docker)
    eval_worker.worker.EvalWorker(queue_url, logs_root, backend, visibility_timeout).run(once, idle_exit)
    eval_worker.report.write_run_report(predictions, dataset, run, logs_root, attempt=1, report_dir=None)
    eval_worker.layout.official_run_id(run, attempt), instance_log_dir(...)
CLI:
    python -m eval_worker --queue URL [--logs-root DIR] [--once] [--idle-exit S] [--visibility-timeout S]
"""
