"""The official run report, with infrastructure failures where they belong (infra_failure_ids, never unresolved or
empty-patch ids), from swebench's own make_run_report over the rows."""

import json

from contract.models import OOM_KILLED
from dispatcher.report import infra_reason, mark_infra_failures


def test_infra_failures_leave_the_model_scored_ids_and_every_count_follows(tmp_path):
    f = tmp_path / "m.run.json"
    f.write_text(json.dumps({
        "total_instances": 5, "completed_instances": 3, "resolved_instances": 1, "unresolved_instances": 2,
        "empty_patch_instances": 2, "error_instances": 0, "infra_failure_instances": 0,
        "ambiguous_failure_instances": 0, "completed_ids": ["a", "b", "c"], "resolved_ids": ["a"],
        "unresolved_ids": ["b", "c"], "empty_patch_ids": ["d", "e"], "error_ids": [], "infra_failure_ids": [],
        "ambiguous_failure_ids": [], "failure_reasons": {}, "schema_version": 2}))
    mark_infra_failures(f, {"c": "environment_broken", "e": "setup_failed"})
    r = json.loads(f.read_text())
    assert r["unresolved_ids"] == ["b"] and r["empty_patch_ids"] == ["d"] and r["resolved_ids"] == ["a"]
    assert r["infra_failure_ids"] == ["c", "e"] and r["error_ids"] == []
    assert r["failure_reasons"] == {"c": "environment_broken", "e": "setup_failed"}
    assert (r["unresolved_instances"], r["empty_patch_instances"], r["infra_failure_instances"],
            r["error_instances"], r["resolved_instances"]) == (1, 1, 2, 0, 1)


def test_the_reason_is_the_grading_environments_or_the_tasks():
    assert infra_reason({"report": {"infra_failure_reason": "environment_broken"}, "error": None}) == \
        "environment_broken"
    assert infra_reason({"report": None, "error": "rate_limited: the upstream refused"}) == "rate_limited"
    assert infra_reason({"report": None, "error": "setup failed: git clone x failed"}) == "setup_failed"
    assert infra_reason({"report": None, "error": None}) == "infra_error"
    # a task killed for memory: by the engine or ECS (the driver lands it), or seen by its runner in its cgroup
    assert infra_reason({"report": None, "error": "oom_killed: the task ended (code 137) without sending its"
                                                  " result"}) == OOM_KILLED
    assert infra_reason({"report": None, "error": "oom_killed: the kernel killed a process of the task at its"
                                                  " memory limit of 4096 MiB (harness submitted)"}) == OOM_KILLED
