"""evalplane eval worker: grades patches with swebench's own code, with the docker or the process grader.

Python API:
    eval_worker.grading.grade(job, patch, logs_root, grader=None) -> Verdict   grader: a Grader or its name
    eval_worker.graders.GRADERS / Grader / resolve_grader(name_or_grader, GraderOptions(...))   graders by name
    eval_worker.docker_backend.DockerGrader(client=None, resolver=None)   "docker": official run_instance, by digest
    eval_worker.process_grader.ProcessGrader(root=None, keep=False, recipes=None)   "process": no Docker; a confined
                                                                  sandbox, per-(repo, version) environments from recipes
    eval_worker.environments.RecipeBook.load(path) / process_environment(recipe) / wheelhouse(reqs, py)
    eval_worker.pinning.ImageResolver(database_url=None, registry=None, require_pinned=False)
    eval_worker.validation.validate(rows, conn, grader="docker", ...) / validate_instance(row, ...)
    eval_worker.validation.validated(conn, instance_rows, backend="docker") -> {iid: ValidationRecord | None}
    eval_worker.mirror.mirror(rows, registry, conn, pull=True) -> (records, errors)
    eval_worker.images.build_image(row, repos_dir=..., tag=None, broken=None) / build_images(rows, ...)
    eval_worker.worker.EvalWorker(queue_url, logs_root, grader, visibility_timeout).run(once, idle_exit)
                                            (signs verdicts with $EVALPLANE_VERDICT_KEY)
    eval_worker.tamper.tamper_flags(patch, instance_row) -> [TamperFlag]   what the patch touches that grading reads
    eval_worker.report.write_run_report(predictions, dataset, run, logs_root, attempt=1, report_dir=None)
    eval_worker.report.apply_infra_entries(report, {iid: report_entry})   infra failures out of unresolved
    eval_worker.layout.official_run_id(run, attempt), instance_log_dir(...)
CLI: see eval_worker/__main__.py (worker, validate, mirror) and images/swebench/build.py; docs/grading.md.
"""
