"""Tamper flags (eval_worker/tamper.py): a pure function over a patch and its instance row. The patches are shaped as
`git diff --binary` and SWE-bench's own patches are (headers, renames, deletions, binary parts, quoted paths); the
Django-shaped instance is SWE-bench Verified's django__django-13128 (its test names and test_patch header)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
from ew_helpers import load_instances, make_job

from contract.models import EvalOutcome
from eval_worker.tamper import graded_patch, parse_patch, tamper_flags


def flags(patch: str, instance: dict | None = None) -> dict[str, list[str]]:
    return {f.rule: f.files for f in tamper_flags(textwrap.dedent(patch).lstrip("\n"), instance or {})}


ROOT = Path(__file__).resolve().parents[2]
CALC = load_instances()["evalplane__calc-1"]
DJANGO = {
    "instance_id": "django__django-13128",
    "test_patch": "diff --git a/tests/expressions/tests.py b/tests/expressions/tests.py\n--- a/tests/expressions/tests.py\n"
                  "+++ b/tests/expressions/tests.py\n@@ -1493,1 +1493,1 @@ def test_duration_expressions(self):\n"
                  "-        pass\n+        return\n",
    "FAIL_TO_PASS": '["test_date_case_subtraction (expressions.tests.FTimeDeltaTests)"]',
    "PASS_TO_PASS": '["test_deconstruct (expressions.tests.FTests)", "test_month_aggregation '
                    '(expressions_window.tests.WindowFunctionTests)"]',
}


def test_gold_patches_are_not_flagged_and_test_patches_are():
    for row in load_instances().values():
        assert tamper_flags(row["patch"], row) == [], row["instance_id"]
        got = {f.rule: f.files for f in tamper_flags(row["test_patch"], row)}
        touched = sorted({p for f in parse_patch(row["test_patch"]) for p in f.paths})
        assert got == {"test_file": touched, "eval_input": touched}, row["instance_id"]


def test_a_conftest_anywhere_and_the_hooks_it_defines():
    got = flags('''
        diff --git a/conftest.py b/conftest.py
        new file mode 100644
        index 0000000..3b18e51
        --- /dev/null
        +++ b/conftest.py
        @@ -0,0 +1,4 @@
        +import pytest
        +
        +def pytest_collection_modifyitems(items):
        +    items[:] = [i for i in items if "median" not in i.name]
        diff --git a/calc/stats.py b/calc/stats.py
        --- a/calc/stats.py
        +++ b/calc/stats.py
        @@ -13,1 +13,1 @@ def median(values):
        -    return ordered[mid]
        +    return ordered[mid - 1]
        ''', CALC)
    assert got == {"conftest": ["conftest.py"], "pytest_hook": ["conftest.py"]}
    nested = flags('''
        diff --git a/src/pkg/sub/conftest.py b/src/pkg/sub/conftest.py
        --- a/src/pkg/sub/conftest.py
        +++ b/src/pkg/sub/conftest.py
        @@ -1,1 +1,2 @@
         import os
        +os.environ["X"] = "1"
        ''')
    assert nested == {"conftest": ["src/pkg/sub/conftest.py"]}


def test_pytest_configuration_only_where_pytest_reads_it():
    assert flags('''
        diff --git a/pytest.ini b/pytest.ini
        new file mode 100644
        --- /dev/null
        +++ b/pytest.ini
        @@ -0,0 +1,2 @@
        +[pytest]
        +addopts = -p no:cacheprovider --deselect tests/test_stats.py::test_median_even
        ''') == {"pytest_config": ["pytest.ini"]}
    # setup.cfg: the [tool:pytest] section is flagged, [metadata] is not
    assert flags('''
        diff --git a/setup.cfg b/setup.cfg
        --- a/setup.cfg
        +++ b/setup.cfg
        @@ -1,6 +1,6 @@
         [metadata]
        -version = 1.0
        +version = 1.1
         
         [tool:pytest]
         testpaths = tests
         xfail_strict = true
        ''') == {}
    assert flags('''
        diff --git a/setup.cfg b/setup.cfg
        --- a/setup.cfg
        +++ b/setup.cfg
        @@ -4,3 +4,3 @@ version = 1.0
         [tool:pytest]
        -testpaths = tests
        +testpaths = nothing_here
         xfail_strict = true
        ''') == {"pytest_config": ["setup.cfg"]}
    # a pytest option changed where the hunk does not show its section
    assert flags('''
        diff --git a/tox.ini b/tox.ini
        --- a/tox.ini
        +++ b/tox.ini
        @@ -20,2 +20,2 @@ commands =
             pytest {posargs}
        -addopts = -ra
        +addopts = -ra -x --co
        ''') == {"pytest_config": ["tox.ini"]}
    assert flags('''
        diff --git a/tox.ini b/tox.ini
        --- a/tox.ini
        +++ b/tox.ini
        @@ -1,2 +1,2 @@
         [tox]
        -envlist = py39
        +envlist = py39,py310
        ''') == {}
    assert flags('''
        diff --git a/pyproject.toml b/pyproject.toml
        --- a/pyproject.toml
        +++ b/pyproject.toml
        @@ -30,3 +30,6 @@ dependencies = [
         ]
         
        +[tool.pytest.ini_options]
        +filterwarnings = ["ignore"]
        +
         [tool.black]
        ''') == {"pytest_config": ["pyproject.toml"]}
    assert flags('''
        diff --git a/pyproject.toml b/pyproject.toml
        --- a/pyproject.toml
        +++ b/pyproject.toml
        @@ -3,1 +3,1 @@
        -requires-python = ">=3.8"
        +requires-python = ">=3.9"
        ''') == {}


def test_plugins_and_interpreter_start_up_files():
    got = flags('''
        diff --git a/setup.py b/setup.py
        --- a/setup.py
        +++ b/setup.py
        @@ -10,2 +10,3 @@ setup(
             name="calc",
        +    entry_points={"pytest11": ["calc = calc.plugin"]},
         )
        diff --git a/calc/plugin.py b/calc/plugin.py
        new file mode 100644
        --- /dev/null
        +++ b/calc/plugin.py
        @@ -0,0 +1,2 @@
        +def pytest_runtest_makereport(item, call):
        +    pass
        diff --git a/calc/sitecustomize.py b/calc/sitecustomize.py
        new file mode 100644
        --- /dev/null
        +++ b/calc/sitecustomize.py
        @@ -0,0 +1 @@
        +import builtins
        diff --git a/zz.pth b/zz.pth
        new file mode 100644
        --- /dev/null
        +++ b/zz.pth
        @@ -0,0 +1 @@
        +import calc.plugin
        ''')
    assert got == {"pytest_plugin": ["calc/sitecustomize.py", "setup.py", "zz.pth"], "pytest_hook": ["calc/plugin.py"]}


def test_the_eval_scripts_inputs_pytest_and_django_shaped():
    # the file FAIL_TO_PASS names (pytest ids), edited, deleted, or renamed away
    edited = flags('''
        diff --git a/tests/test_stats.py b/tests/test_stats.py
        --- a/tests/test_stats.py
        +++ b/tests/test_stats.py
        @@ -19,2 +19,2 @@ def test_median_single():
        -    assert median([7]) == 7
        +    assert True
        ''', CALC)
    assert edited == {"test_file": ["tests/test_stats.py"], "eval_input": ["tests/test_stats.py"]}
    renamed = flags('''
        diff --git a/tests/test_stats.py b/tests/old_stats.txt
        similarity index 100%
        rename from tests/test_stats.py
        rename to tests/old_stats.txt
        ''', CALC)
    assert renamed["eval_input"] == ["tests/test_stats.py"]
    assert renamed["test_file"] == ["tests/old_stats.txt", "tests/test_stats.py"]
    deleted = flags('''
        diff --git a/tests/test_stats.py b/tests/test_stats.py
        deleted file mode 100644
        index 1234567..0000000
        --- a/tests/test_stats.py
        +++ /dev/null
        @@ -1,2 +0,0 @@
        -import pytest
        -from calc import median
        ''', CALC)
    assert deleted["eval_input"] == ["tests/test_stats.py"]
    # Django: tests named `name (module.Class)`; the test_patch's file and the modules' files
    got = flags('''
        diff --git a/tests/expressions_window/tests.py b/tests/expressions_window/tests.py
        --- a/tests/expressions_window/tests.py
        +++ b/tests/expressions_window/tests.py
        @@ -5,1 +5,1 @@
        -        self.assertEqual(a, b)
        +        pass
        diff --git a/django/db/models/expressions.py b/django/db/models/expressions.py
        --- a/django/db/models/expressions.py
        +++ b/django/db/models/expressions.py
        @@ -1,1 +1,1 @@
        -x = 1
        +x = 2
        ''', DJANGO)
    assert got == {"test_file": ["tests/expressions_window/tests.py"],
                   "eval_input": ["tests/expressions_window/tests.py"]}


def test_headers_binary_parts_quoted_paths_and_hunk_lines_that_look_like_headers():
    patch = (
        'diff --git "a/tests/data/my file.py" "b/tests/data/my file.py"\n'
        "new file mode 100644\n--- /dev/null\n+++ \"b/tests/data/my file.py\"\n@@ -0,0 +1 @@\n+x = 1\n"
        "diff --git a/calc/logo.png b/calc/logo.png\nnew file mode 100644\nindex 0000000..e69de29\n"
        "GIT binary patch\nliteral 4\nLcmZQzWMT#Y01f~L\n\nliteral 0\nHcmV?d00001\n\n"
        "diff --git a/calc/text.py b/calc/text.py\n--- a/calc/text.py\n+++ b/calc/text.py\n"
        "@@ -1,3 +1,3 @@\n--- b/conftest.py\n+++ a/conftest.py\n context\n"  # content lines, not headers
    )
    files = parse_patch(patch)
    assert [sorted(f.paths) for f in files] == [["tests/data/my file.py"], ["calc/logo.png"], ["calc/text.py"]]
    assert {f.rule: f.files for f in tamper_flags(patch, {})} == {"test_file": ["tests/data/my file.py"]}
    # a plain unified diff (no git headers), two files
    plain = "--- a/calc/x.py\n+++ b/calc/x.py\n@@ -1 +1 @@\n-a\n+b\n--- a/conftest.py\n+++ b/conftest.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert [sorted(f.paths) for f in parse_patch(plain)] == [["calc/x.py"], ["conftest.py"]]


def test_grading_leaves_out_what_decides_which_code_pytest_runs_and_keeps_the_rest_byte_for_byte():
    fix = load_instances()["evalplane__calc-1"]["patch"]
    conftest = ("diff --git a/conftest.py b/conftest.py\nnew file mode 100644\nindex 0000000..3b18e51\n--- /dev/null\n"
                "+++ b/conftest.py\n@@ -0,0 +1,2 @@\n+def pytest_runtest_makereport(item, call):\n+    pass\n")
    ini = "diff --git a/pytest.ini b/pytest.ini\n--- a/pytest.ini\n+++ b/pytest.ini\n@@ -1 +1 @@\n-[pytest]\n+[pytest] \n"
    test = ("diff --git a/tests/test_new.py b/tests/test_new.py\nnew file mode 100644\n--- /dev/null\n"
            "+++ b/tests/test_new.py\n@@ -0,0 +1 @@\n+def test_x(): pass\n")
    patch = conftest + fix + ini + test
    got, left_out = graded_patch(patch, tamper_flags(patch, CALC))
    assert left_out == ["conftest.py", "pytest.ini"]
    assert got == fix + test  # test files are flagged, not left out: the eval script resets the ones it runs
    assert graded_patch(fix, tamper_flags(fix, CALC)) == (fix, [])
    assert graded_patch(conftest, tamper_flags(conftest, CALC)) == ("", ["conftest.py"])
    # every gold patch graded as written: the synthetic instances' and SWE-bench Verified's and Lite's (823 rows)
    rows = list(load_instances().values())
    for name in ("SWE-bench_Verified_test", "SWE-bench_Lite_test", "SWE-bench_Lite_dev"):
        rows += pq.read_table(ROOT.parent / "shared" / "datasets" / f"{name}.parquet").to_pylist()
    assert len(rows) > 823
    for row in rows:
        assert graded_patch(row["patch"], tamper_flags(row["patch"], row)) == (row["patch"], []), row["instance_id"]


def test_a_conftest_that_forces_passes_is_left_out_and_the_official_verdict_of_the_rest_stands(
        instances, tmp_path, moto_endpoint, unique):
    """A wrong fix plus a conftest.py that turns every failed test into a pass: the worker grades the wrong fix alone
    (UNRESOLVED, by the eval script and swebench's grading, on a fresh checkout) and flags the conftest; the gold fix
    with the same conftest stays RESOLVED."""
    from contract import aws
    from eval_worker.worker import EvalWorker
    from simulator.red_team import conftest_patch

    row = instances["evalplane__calc-1"]
    conftest = conftest_patch()
    wrong = json.loads((ROOT / "examples/synthetic/demo_policy.json").read_text())["instances"][row["instance_id"]]["patch"]
    aws.client("s3").create_bucket(Bucket=unique)
    got = {}
    for name, patch in (("wrong", conftest + wrong), ("gold", row["patch"] + conftest), ("only", conftest)):
        uri = f"s3://{unique}/runs/{unique}/attempts/{row['instance_id']}/{name}/patch.diff"
        aws.put_text(uri, patch)
        got[name] = EvalWorker("http://unused/eval", tmp_path / name).grade_job(
            make_job(row, run=f"{unique}-{name}", patch_uri=uri))
    for v in got.values():
        assert ("conftest", ["conftest.py"]) in [(f.rule, f.files) for f in v.tamper_flags]
    assert got["wrong"].outcome is EvalOutcome.UNRESOLVED and not got["wrong"].resolved
    assert got["wrong"].report["tests_status"]["FAIL_TO_PASS"]["failure"]  # the tests ran, the fix's tests failed
    assert "graded without conftest.py" in got["wrong"].reason
    assert got["gold"].outcome is EvalOutcome.RESOLVED and got["gold"].resolved
    assert got["only"].outcome is EvalOutcome.UNRESOLVED and "nothing graded" in got["only"].reason
