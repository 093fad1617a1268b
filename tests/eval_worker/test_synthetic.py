"""The synthetic instances: deterministic regeneration, v5 format, official eval_script shape, bundles."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pyarrow.parquet as pq
import pytest
from ew_helpers import ROOT, SYNTH, bundle_for

VERIFIED = ROOT.parent / "shared" / "datasets" / "SWE-bench_Verified_test.parquet"
V5_KEYS = [
    "repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
    "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit", "image",
    "eval_script", "log_parser", "eval_type",
]


def test_make_instances_check_is_deterministic():
    """Regenerating gives byte-identical instances.jsonl, demo_policy.json and bundles
    (what `python examples/synthetic/make_instances.py --check` does, run in-process for speed)."""
    spec = importlib.util.spec_from_file_location("ep_make_instances", SYNTH / "make_instances.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.check(SYNTH) == []
    assert sorted(mod.OUTPUTS) == sorted(
        ["instances.jsonl", "demo_policy.json", "repos/evalplane__calc.bundle", "repos/evalplane__textkit.bundle"])


def test_instances_are_v5_rows(instances, demo_policy):
    from swebench.harness.utils import load_swebench_dataset, make_test_spec

    assert len(instances) == 5
    assert len({r["problem_statement"] for r in instances.values()}) == 5
    loaded = load_swebench_dataset(str(SYNTH / "instances.jsonl"), "test")
    assert [r["instance_id"] for r in loaded] == list(instances)
    for iid, row in instances.items():
        assert list(row) == V5_KEYS
        owner, name = row["repo"].split("/")
        assert iid.startswith(f"{owner}__{name}-")
        assert row["image"] == f"swebench/sweb.eval.x86_64.{owner}_1776_{iid.split('__')[1]}:latest"
        assert row["environment_setup_commit"] == row["base_commit"]
        assert (row["version"], row["log_parser"], row["eval_type"], row["hints_text"]) == (
            "0.1", "parse_log_pytest", "pass_and_fail", "")
        f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
        assert f2p and p2p and not set(f2p) & set(p2p)
        ts = make_test_spec(row)
        assert ts.FAIL_TO_PASS == f2p and ts.PASS_TO_PASS == p2p
    # demo policy: gold by default, exactly one wrong patch and one empty patch
    assert demo_policy["default"] == {"action": "gold"}
    actions = {iid: p["action"] for iid, p in demo_policy["instances"].items()}
    assert sorted(actions.values()) == ["empty", "patch"]
    assert set(actions) <= set(instances)


@pytest.mark.skipif(not VERIFIED.exists(), reason="shared datasets not present")
def test_eval_script_matches_official_shape(instances):
    """Same lines as a real Verified pytest row's eval_script, minus the conda/pip lines."""
    real = next(r for r in pq.read_table(VERIFIED).to_pylist() if r["repo"] == "pytest-dev/pytest")

    def shape(script: str, base: str, files: str) -> list[str]:
        body = script.split("<<'", 1)
        head = body[0].replace(base, "<BASE>").replace(files, "<FILES>").splitlines()
        tail = body[1].split("\n", 1)[1]
        delim = body[1].split("'", 1)[0]
        tail = tail.split(delim + "\n", 1)[1].replace(base, "<BASE>").replace(files, "<FILES>").splitlines()
        skip = ("source /opt/miniconda3", "conda activate", "python -m pip install")
        return [line for line in head + ["<HEREDOC>"] + tail if not line.startswith(skip)]

    real_files = "testing/logging/test_fixture.py"
    assert real_files in real["eval_script"]
    expected = shape(real["eval_script"], real["base_commit"], real_files)
    for row in instances.values():
        files = row["eval_script"].split("pytest -rA ", 1)[1].split("\n", 1)[0]
        assert shape(row["eval_script"], row["base_commit"], files) == expected
        assert f"git apply -v - <<'EOF_114329324912'\n{row['test_patch']}\nEOF_114329324912\n" in row["eval_script"]


def test_bundles_clone_at_base_commit_only(instances, tmp_path):
    for row in instances.values():
        dest = tmp_path / row["instance_id"]
        subprocess.run(["git", "clone", "-q", bundle_for(row), str(dest)], check=True)
        log = subprocess.run(["git", "log", "--all", "--format=%H"], cwd=dest, capture_output=True, text=True,
                             check=True).stdout.split()
        assert log == [row["base_commit"]]  # history pruned at base: the fix is not in history
