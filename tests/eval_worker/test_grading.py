"""grade(): real git, real swebench functions, the process backend."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ew_helpers import make_job, patch_from_edits

from contract.models import EvalOutcome, Verdict
from eval_worker.graders import Grader
from eval_worker.grading import grade, infra_entry
from eval_worker.layout import LOG_FILES, instance_log_dir, official_run_id
from eval_worker.process_grader import ProcessGrader
from eval_worker.report import write_run_report
from eval_worker.sandbox import map_container_paths

MODEL = "evalplane/demo-model"
NON_APPLYING = """\
diff --git a/textkit/wrap.py b/textkit/wrap.py
--- a/textkit/wrap.py
+++ b/textkit/wrap.py
@@ -1,4 +1,4 @@
-\"\"\"This line is not in the file.\"\"\"
+\"\"\"Neither is this one.\"\"\"
 
 
 def truncate(text, width, placeholder="..."):
"""


@pytest.fixture(scope="module")
def logs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval-logs")


DEMO_GOLD = ("evalplane__calc-2", "evalplane__textkit-1")  # gold in the demo run below


@pytest.fixture(scope="module")
def demo(instances, demo_policy, logs_root) -> dict[str, Verdict]:
    """The demo model's run (run "demo"): policy patches (gold / wrong / empty), except that
    evalplane__textkit-3 gets a patch that does not apply instead of gold."""
    assert {i for i in instances if i not in demo_policy["instances"]} == {*DEMO_GOLD, "evalplane__textkit-3"}
    jobs = {}
    for iid, row in instances.items():
        action = demo_policy["instances"].get(iid, demo_policy["default"])
        if action["action"] == "empty":
            with pytest.raises(ValueError):
                grade(make_job(row, run="demo", model=MODEL), "", logs_root)
            continue
        patch = action["patch"] if action["action"] == "patch" else row["patch"]
        if iid == "evalplane__textkit-3":
            patch = NON_APPLYING
        jobs[iid] = (make_job(row, run="demo", model=MODEL), patch)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(lambda jp: grade(jp[0], jp[1], logs_root), jobs.values())))


@pytest.fixture(scope="module")
def gold(instances, logs_root, demo) -> dict[str, Verdict]:
    """Every instance's gold patch: the demo run's gold-replayed ones, the rest graded concurrently in
    run "gold" (model "gold")."""
    rest = [row for iid, row in instances.items() if iid not in DEMO_GOLD]

    def one(row):
        return row["instance_id"], grade(make_job(row, run="gold", model="gold"), row["patch"], logs_root)

    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = dict(pool.map(one, rest))
    return {**verdicts, **{iid: demo[iid] for iid in DEMO_GOLD}}


@pytest.mark.parametrize("iid", ["evalplane__calc-1", "evalplane__calc-2", "evalplane__textkit-1",
                                 "evalplane__textkit-2", "evalplane__textkit-3"])
def test_gold_patch_resolves(gold, instances, iid):
    v = gold[iid]
    assert v.outcome is EvalOutcome.RESOLVED and v.resolved, v
    ts = v.report["tests_status"]
    assert ts["FAIL_TO_PASS"]["success"] == json.loads(instances[iid]["FAIL_TO_PASS"])
    assert ts["PASS_TO_PASS"]["success"] == json.loads(instances[iid]["PASS_TO_PASS"])
    assert not ts["FAIL_TO_PASS"]["failure"] and not ts["PASS_TO_PASS"]["failure"]


def test_official_layout_files(gold, logs_root, instances):
    for iid in instances:
        run, model = ("demo", MODEL) if iid in DEMO_GOLD else ("gold", "gold")
        d = logs_root / "logs" / "run_evaluation" / run / model.replace("/", "__") / iid
        assert d == instance_log_dir(logs_root, run, 1, model, iid)
        assert sorted(p.name for p in d.iterdir()) == sorted(LOG_FILES)
        report = json.loads((d / "report.json").read_text())
        assert report[iid] == gold[iid].report
        assert (d / "patch.diff").read_text() == instances[iid]["patch"]
        out = (d / "test_output.txt").read_text()
        assert ">>>>> Start Test Output" in out and ">>>>> End Test Output" in out
        assert ">>>>> Test Exit Code: 0" in out
        assert ">>>>> Applied Patch" in (d / "run_instance.log").read_text()
        # the official eval.sh (container paths), as make_test_spec builds it
        assert "cd /testbed\n" in (d / "eval.sh").read_text()


def test_demo_wrong_patch_is_unresolved(demo, demo_policy):
    wrong = next(i for i, a in demo_policy["instances"].items() if a["action"] == "patch")
    v = demo[wrong]
    assert v.outcome is EvalOutcome.UNRESOLVED and not v.resolved
    assert v.report["patch_successfully_applied"] is True
    assert v.report["tests_status"]["FAIL_TO_PASS"]["failure"]


def test_non_applying_patch_is_apply_failed(demo, logs_root):
    v = demo["evalplane__textkit-3"]
    assert v.outcome is EvalOutcome.APPLY_FAILED and not v.resolved
    assert v.report["patch_successfully_applied"] is False
    d = instance_log_dir(logs_root, "demo", 1, MODEL, "evalplane__textkit-3")
    log = (d / "run_instance.log").read_text()
    assert ">>>>> Patch Apply Failed" in log
    for cmd in ("git apply --verbose", "git apply --verbose --3way", "git apply --verbose --reject",
                "patch --batch --forward --fuzz=5 -p1 -i"):
        assert f"Failed to apply patch to container: {cmd}\n" in log
    # as in the official harness: no test run, no report.json (make_run_report counts it in error_ids)
    assert not (d / "report.json").exists() and not (d / "test_output.txt").exists()


def test_run_report_official_keys(demo, logs_root, instances, demo_policy, tmp_path):
    preds = {}
    for iid, row in instances.items():
        action = demo_policy["instances"].get(iid, demo_policy["default"])
        patch = {"empty": "", "patch": action.get("patch")}.get(action["action"], row["patch"])
        if iid == "evalplane__textkit-3":
            patch = NON_APPLYING
        preds[iid] = {"instance_id": iid, "model_name_or_path": MODEL, "model_patch": patch}
    path = write_run_report(preds, list(instances.values()), "demo", logs_root, report_dir=tmp_path)
    assert path == tmp_path / "evalplane__demo-model.demo.json"
    rep = json.loads(path.read_text())
    assert rep["resolved_ids"] == ["evalplane__calc-2", "evalplane__textkit-1"]
    assert rep["unresolved_ids"] == ["evalplane__calc-1"]
    assert rep["empty_patch_ids"] == ["evalplane__textkit-2"]
    assert rep["error_ids"] == ["evalplane__textkit-3"]
    assert rep["total_instances"] == 5 and rep["schema_version"] == 2


def test_attempt_two_does_not_overwrite_attempt_one(gold, instances, logs_root):
    row = instances["evalplane__calc-1"]
    one = instance_log_dir(logs_root, "gold", 1, "gold", row["instance_id"])
    before = {p.name: p.read_bytes() for p in one.iterdir()}
    v2 = grade(make_job(row, run="gold", model="gold", attempt=2), NON_APPLYING, logs_root)
    assert v2.outcome is EvalOutcome.APPLY_FAILED
    two = instance_log_dir(logs_root, "gold", 2, "gold", row["instance_id"])
    assert two.parent.parent.name == official_run_id("gold", 2) == "gold.attempt-2"
    assert (two / "run_instance.log").exists() and (two / "patch.diff").read_text() == NON_APPLYING
    assert {p.name: p.read_bytes() for p in one.iterdir()} == before


def test_regrading_is_idempotent(demo, instances, demo_policy, logs_root):
    iid = next(i for i, a in demo_policy["instances"].items() if a["action"] == "patch")
    job = make_job(instances[iid], run="demo", model=MODEL)
    d = instance_log_dir(logs_root, "demo", 1, MODEL, iid)
    report_before = (d / "report.json").read_text()
    again = grade(job, demo_policy["instances"][iid]["patch"], logs_root)
    first = demo[iid]
    assert (again.outcome, again.resolved, again.report) == (first.outcome, first.resolved, first.report)
    assert (d / "report.json").read_text() == report_before


def test_empty_patch_is_refused(instances, tmp_path):
    row = instances["evalplane__calc-1"]
    for patch in ("", "  \n", None):
        with pytest.raises(ValueError):
            grade(make_job(row), patch, tmp_path)
    assert not (tmp_path / "logs").exists()


def _pids_with(token: str) -> set[int]:
    """Live processes of this host whose command line holds token (seen from outside the grading's namespaces)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.add(int(entry))
            except OSError:
                pass
    return found


def test_endless_test_times_out_and_group_is_killed(instances, tmp_path):
    row = instances["evalplane__calc-1"]
    token = f"evalplane-loop-{os.urandom(6).hex()}"
    # the patched code loops, and so does a process it starts (the grading cannot write outside its sandbox, so the
    # test finds both by the token in their command lines)
    patch = patch_from_edits(row, [(
        "calc/stats.py",
        "    mid = len(ordered) // 2\n",
        ("    import subprocess, sys, time\n"
        f"    subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.05)', {token!r}])\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "    mid = len(ordered) // 2\n"),
    )], tmp_path)
    seen: set[int] = set()
    done = threading.Event()

    def watch():
        while not done.wait(0.1):
            seen.update(_pids_with(token))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    # long enough for the eval script's `pip install -e .` to finish and the tests to start looping
    try:
        v = grade(make_job(row, run="loop", timeout_s=20), patch, tmp_path / "logs-root")
    finally:
        done.set()
        watcher.join()
    assert time.monotonic() - t0 < 60
    assert v.outcome is EvalOutcome.TIMEOUT and not v.resolved
    d = instance_log_dir(tmp_path / "logs-root", "loop", 1, "evalplane/demo-model", row["instance_id"])
    out = (d / "test_output.txt").read_text()
    assert out.endswith("\n\nTimeout error: 20 seconds exceeded.")
    assert not (d / "report.json").exists()  # official: a timeout has no report.json
    assert seen, "the looping process never ran"
    deadline = time.monotonic() + 5
    while _pids_with(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_with(token), "a process the looping test started survived the timeout"


def test_clone_failure_is_infra_error(instances, tmp_path):
    row = instances["evalplane__calc-1"]
    v = grade(make_job(row, repo_source=str(tmp_path / "missing.bundle")), row["patch"], tmp_path)
    assert v.outcome is EvalOutcome.INFRA_ERROR and not v.resolved
    assert v.report == infra_entry("sandbox_unavailable")  # official keys + v5 infra fields
    d = instance_log_dir(tmp_path, "run1", 1, "evalplane/demo-model", row["instance_id"])
    assert not (d / "report.json").exists()
    # a base commit the repository does not have: also ours, not the model's
    bad = {**row, "base_commit": "0" * 40}
    v = grade(make_job(bad), row["patch"], tmp_path)
    assert v.outcome is EvalOutcome.INFRA_ERROR and "sandbox" in v.reason


def test_process_grader_is_a_grader():
    assert isinstance(ProcessGrader(), Grader)


def test_container_paths_are_mapped_outside_heredocs_only():
    script = (
        "cd /testbed\ngit config --global --add safe.directory /testbed\n"
        "git apply -v - <<'EOF_1'\n+open('/testbed/x')\nEOF_1\n"
        "cat /testbed/a /testbedx /eval.sh /tmp/patch.diff\n"
    )
    mapped = map_container_paths(script, {"/testbed": "/sb/tb", "/eval.sh": "/sb/eval.sh",
                                          "/tmp/patch.diff": "/sb/tmp/patch.diff"})
    assert mapped == (
        "cd /sb/tb\ngit config --global --add safe.directory /sb/tb\n"
        "git apply -v - <<'EOF_1'\n+open('/testbed/x')\nEOF_1\n"
        "cat /sb/tb/a /testbedx /sb/eval.sh /sb/tmp/patch.diff\n"
    )


def test_sandbox_env_is_isolated(instances, tmp_path):
    row = instances["evalplane__calc-1"]
    sb = ProcessGrader(root=tmp_path).create(instance=row, repo_source=make_job(row).repo_source)
    try:
        r = sb.exec("git config --global --add safe.directory /testbed; echo $HOME $TMPDIR $GIT_CONFIG_GLOBAL; "
                    "echo err >&2; command -v python || echo no-python; git rev-parse HEAD; "
                    "echo ${AWS_SECRET_ACCESS_KEY:-none}; "
                    "source /opt/miniconda3/bin/activate && conda activate testbed && command -v python pip pytest")
        home, tmpdir, gitcfg = r.output.split("\n")[0].split()
        assert all(p.startswith(str(tmp_path)) for p in (home, tmpdir, gitcfg))
        assert f"directory = {sb.testbed}" in Path(gitcfg).read_text()  # /testbed mapped, own gitconfig
        lines = r.output.split("\n")
        assert lines[1] == "err"  # stderr merged in order
        assert not lines[2].startswith(sys.prefix)  # the worker's own python is not on PATH
        assert lines[3] == row["base_commit"]
        assert lines[4] == "none"
        # `conda activate testbed` (the eval script's) gives the instance's environment, not the worker's
        testbed_bin = sb.environment.conda_root / "envs" / "testbed" / "bin"
        assert lines[5:8] == [str(testbed_bin / name) for name in ("python", "pip", "pytest")]
    finally:
        sb.close()
    assert not sb.root.exists()
