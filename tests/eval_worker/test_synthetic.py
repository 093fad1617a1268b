"""The synthetic instances: deterministic regeneration, v5 format, official eval_script shape, and
repositories that behave like real ones (history after every base commit, the real fix in it, tags)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

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
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    assert mod.check(SYNTH) == []
    assert sorted(mod.OUTPUTS) == sorted(["instances.jsonl", "demo_policy.json", "repos/environments.toml",
                                          "repos/evalplane__calc.bundle", "repos/evalplane__textkit.bundle"])


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
        # as upstream: one environment setup commit per (repo, version), the newest base of that version
        same_version = [r for r in instances.values() if (r["repo"], r["version"]) == (row["repo"], row["version"])]
        assert row["environment_setup_commit"] == same_version[-1]["base_commit"]
        assert (row["log_parser"], row["eval_type"], row["hints_text"]) == ("parse_log_pytest", "pass_and_fail", "")
        f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
        assert f2p and p2p and not set(f2p) & set(p2p)
        ts = make_test_spec(row)
        assert ts.FAIL_TO_PASS == f2p and ts.PASS_TO_PASS == p2p
    # demo policy: gold by default, exactly one wrong patch and one empty patch
    assert demo_policy["default"] == {"action": "gold"}
    actions = {iid: p["action"] for iid, p in demo_policy["instances"].items()}
    assert sorted(actions.values()) == ["empty", "patch"]
    assert set(actions) <= set(instances)
    assert {iid: r["version"] for iid, r in instances.items()} == {
        "evalplane__calc-1": "0.2", "evalplane__calc-2": "0.2", "evalplane__textkit-1": "1.1",
        "evalplane__textkit-2": "1.1", "evalplane__textkit-3": "1.2"}


@pytest.mark.skipif(not VERIFIED.exists(), reason="shared datasets not present")
def test_eval_script_matches_official_shape(instances):
    """Line for line the shape of a real Verified pytest-dev row's eval_script, conda activation and
    `python -m pip install -e .` included."""
    real = next(r for r in pq.read_table(VERIFIED).to_pylist() if r["repo"] == "pytest-dev/pytest")

    def shape(script: str, base: str, files: str) -> list[str]:
        body = script.split("<<'", 1)
        head = body[0].replace(base, "<BASE>").replace(files, "<FILES>").splitlines()
        tail = body[1].split("\n", 1)[1]
        delim = body[1].split("'", 1)[0]
        tail = tail.split(delim + "\n", 1)[1].replace(base, "<BASE>").replace(files, "<FILES>").splitlines()
        return head + ["<HEREDOC>"] + tail

    real_files = "testing/logging/test_fixture.py"
    assert real_files in real["eval_script"]
    expected = shape(real["eval_script"], real["base_commit"], real_files)
    assert "python -m pip install -e ." in expected and "conda activate testbed" in expected
    for row in instances.values():
        files = row["eval_script"].split("pytest -rA ", 1)[1].split("\n", 1)[0]
        assert shape(row["eval_script"], row["base_commit"], files) == expected
        assert f"git apply -v - <<'EOF_114329324912'\n{row['test_patch']}\nEOF_114329324912\n" in row["eval_script"]


def _git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def test_bundles_carry_history_after_every_base_with_its_real_fix_and_tags(instances, tmp_path):
    for row in instances.values():
        dest = tmp_path / row["instance_id"]
        subprocess.run(["git", "clone", "-q", bundle_for(row), str(dest)], check=True)
        base = row["base_commit"]
        later = _git(dest, "rev-list", "--all", "--not", base).split()
        assert later, row["instance_id"]  # commits after the base, reachable from the bundle's refs
        # the real fix is the base's child: the gold patch and the test patch, as one upstream commit
        fix = next(c for c in later if _git(dest, "rev-parse", f"{c}^").strip() == base)
        _git(dest, "checkout", "-q", base)
        for patch in (row["patch"], row["test_patch"]):
            subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=dest, check=True)
        _git(dest, "add", "-A")
        assert _git(dest, "write-tree").strip() == _git(dest, "rev-parse", f"{fix}^{{tree}}").strip()
        # release tags before (or at) the base, and after it
        assert _git(dest, "tag", "--merged", base).split(), row["instance_id"]
        assert _git(dest, "tag", "--no-merged", base).split(), row["instance_id"]
        # the bundle's branch points into the future, like a user's bundle of an upstream repository
        assert _git(dest, "rev-parse", "origin/main").strip() in later
