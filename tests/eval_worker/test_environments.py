"""The process backend's environments: recipes, isolation from the worker's own Python, caching and locking,
the infra rule for environments that cannot run the tests, and the synthetic repositories' tag-derived versions.
Real venvs, real pip (offline, from the recipe's wheelhouse), real git and the real swebench grading functions."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ew_helpers import SYNTH, bundle_for, make_job, patch_from_edits

from contract.models import EvalOutcome
from eval_worker.environments import GradingEnvironmentError, RecipeBook, installs_packages
from eval_worker.grading import grade
from eval_worker.images import recipe_for
from eval_worker.layout import BASE_TEST_OUTPUT, LOG_FILES, instance_log_dir
from eval_worker.process_grader import ProcessGrader
from eval_worker.report import write_run_report

RECIPES = SYNTH / "repos" / "environments.toml"
ACTIVATE = "source /opt/miniconda3/bin/activate && conda activate testbed"


def worker_freeze() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                          check=True).stdout


def synthetic_recipe(**changes) -> str:
    """The synthetic calc recipe as TOML, with fields replaced."""
    entry = {"repo": "evalplane/calc", "versions": ["0.2"], "python": ">=3.9",
             "packages": RecipeBook.load(RECIPES).get("evalplane/calc", "0.2").packages,
             "build": RecipeBook.load(RECIPES).get("evalplane/calc", "0.2").build, **changes}
    return "[[environment]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in entry.items())


# ----------------------------------------------------------------------------------- recipe files


@pytest.mark.parametrize("change,expected", [
    ({"packages": ["pytest>=8"]}, "environment[0].packages: Value error, 'pytest>=8': pin every requirement"),
    ({"packages": ['tomli==2.2.1; python_version < "3.11"']}, "environment[0].packages: Value error"),
    ({"python": "three"}, "environment[0].python: Value error, not a version specifier: 'three'"),
    ({"versions": []}, "environment[0].versions: List should have at least 1 item"),
    ({"pkgs": ["x==1"]}, "environment[0].pkgs: Extra inputs are not permitted"),
])
def test_recipe_errors_name_the_file_and_field(tmp_path, change, expected):
    f = tmp_path / "environments.toml"
    f.write_text(synthetic_recipe(**change))
    with pytest.raises(GradingEnvironmentError) as e:
        RecipeBook.load(f)
    assert str(e.value).startswith(f"{f}: ") and expected in str(e.value)


def test_recipe_file_structure_errors(tmp_path):
    f = tmp_path / "environments.toml"
    f.write_text(synthetic_recipe() + synthetic_recipe(versions=["0.3", "0.2"]))
    with pytest.raises(GradingEnvironmentError, match=r"environment\[1\]: evalplane/calc 0.2 has another recipe"):
        RecipeBook.load(f)
    f.write_text("[[environment]\n")
    with pytest.raises(GradingEnvironmentError, match=str(f)):
        RecipeBook.load(f)
    f.write_text("[environments]\nrepo = 'x'\n")
    with pytest.raises(GradingEnvironmentError, match=r"unknown top-level key\(s\) \['environments'\]"):
        RecipeBook.load(f)


def test_synthetic_recipes_cover_every_instance(instances):
    book = RecipeBook.load(RECIPES)
    for row in instances.values():
        recipe = recipe_for(row, SYNTH / "repos")
        assert recipe == book.get(row["repo"], row["version"])
        assert recipe.admits("3.9.2") and "pytest==8.4.2" in recipe.packages  # bullseye's python3 in the images
    with pytest.raises(GradingEnvironmentError, match=r"no recipe for evalplane/calc version 9.9 \(evalplane__calc-1\)"):
        recipe_for({**instances["evalplane__calc-1"], "version": "9.9"}, SYNTH / "repos")


def test_installs_packages_reads_commands_not_patches(instances):
    script = instances["evalplane__textkit-1"]["eval_script"]
    assert installs_packages(script) == ["python -m pip install -e ."]
    heredoc_only = "git apply -v - <<'EOF_1'\n+pip install foo\n+python setup.py develop\nEOF_1\npytest -rA x\n"
    assert installs_packages(heredoc_only) == []
    assert installs_packages("conda install -y numpy\n/opt/x/bin/python3.9 -m pip install .[test]\n") == [
        "conda install -y numpy", "/opt/x/bin/python3.9 -m pip install .[test]"]


# ------------------------------------------------------------------------------- isolation


def test_grading_never_touches_the_worker_environment(instances, tmp_path):
    """A synthetic instance whose eval script runs `python -m pip install -e .`, graded on the process
    backend: the worker's own `pip freeze` is unchanged; the install happened in the instance's environment."""
    row = instances["evalplane__textkit-1"]
    assert "python -m pip install -e ." in row["eval_script"]
    before = worker_freeze()
    v = grade(make_job(row, run="isolation"), row["patch"], tmp_path)
    assert v.outcome is EvalOutcome.RESOLVED, v
    assert worker_freeze() == before
    out = (instance_log_dir(tmp_path, "isolation", 1, "evalplane/demo-model", row["instance_id"])
           / "test_output.txt").read_text()
    # the version from the base commit's tag v1.1.0 (a dev build: the patched work tree is dirty)
    assert re.search(r"Successfully installed textkit-1\.1\.1\.dev0\+g[0-9a-f]{7}\.d\d{8}\n", out), out
    assert "pytest-8.4.2" in out  # the recipe's pytest, not the worker's
    assert f"{sys.prefix}/" not in out


def test_instance_without_recipe_that_installs_is_refused(instances, tmp_path):
    row = instances["evalplane__textkit-1"]
    bundle = tmp_path / "repos" / Path(bundle_for(row)).name
    bundle.parent.mkdir()
    shutil.copy(bundle_for(row), bundle)  # a repository folder without environments.toml
    before = worker_freeze()
    v = grade(make_job(row, run="norecipe", repo_source=str(bundle)), row["patch"], tmp_path / "logs")
    assert v.outcome is EvalOutcome.INFRA_ERROR and not v.resolved
    assert v.report["infra_failure"] is True and v.report["infra_failure_reason"] == "environment_unavailable"
    assert "no environment recipe for evalplane/textkit 1.1" in v.reason
    assert "'python -m pip install -e .'" in v.reason and "evalplane__textkit-1" in v.reason
    d = instance_log_dir(tmp_path / "logs", "norecipe", 1, "evalplane/demo-model", row["instance_id"])
    assert not (d / "test_output.txt").exists() and not (d / "report.json").exists()
    assert worker_freeze() == before


def test_instance_without_recipe_and_without_installs_runs(instances, tmp_path):
    """The fallback: an eval script that installs nothing runs with the worker's Python (as before recipes)."""
    row = dict(instances["evalplane__calc-2"])
    drop = ("source /opt/miniconda3/bin/activate", "conda activate testbed", "python -m pip install -e .")
    row["eval_script"] = "\n".join(ln for ln in row["eval_script"].split("\n") if ln not in drop)
    assert installs_packages(row["eval_script"]) == []
    bundle = tmp_path / "repos" / Path(bundle_for(row)).name
    bundle.parent.mkdir()
    shutil.copy(bundle_for(row), bundle)
    before = worker_freeze()
    v = grade(make_job(row, run="plain", repo_source=str(bundle)), row["patch"], tmp_path / "logs")
    assert v.outcome is EvalOutcome.RESOLVED, v
    assert worker_freeze() == before


# ------------------------------------------------------------------- built once, copied per grading, repaired


def test_environment_is_built_once_each_grading_has_its_own_copy_and_repaired(instances, tmp_path):
    one, two = instances["evalplane__calc-1"], instances["evalplane__calc-2"]
    assert (one["repo"], one["version"]) == (two["repo"], two["version"])
    backend = ProcessGrader(root=tmp_path / "sandboxes", env_root=tmp_path / "envs")
    first = backend.create(instance=one, repo_source=bundle_for(one))
    env = first.environment
    assert env.path.parent == tmp_path / "envs" and env.intact()
    built_at = (env.path / ".complete").stat().st_mtime_ns
    assert not Path(env.python).resolve().is_relative_to(Path(sys.prefix).resolve())

    # a second grading of the same (repo, version) runs beside the first, on the same built environment
    second = ProcessGrader(root=tmp_path / "sandboxes", env_root=tmp_path / "envs").create(
        instance=two, repo_source=bundle_for(two))
    try:
        assert second.environment.path == env.path
        assert (env.path / ".complete").stat().st_mtime_ns == built_at  # reused, not rebuilt

        # what a grading does to its environment stays in its copy: a package removed there ...
        r = second.exec(f"{ACTIVATE} && python -m pip uninstall -y -q iniconfig")
        assert r.exit_code == 0, r.output
        assert second.exec(f"{ACTIVATE} && python -c 'import iniconfig'").exit_code != 0
        # ... is still in the other grading's and in the built one, and the built one's files cannot be written
        assert first.exec(f"{ACTIVATE} && python -c 'import iniconfig'").exit_code == 0
        r = first.exec(f"{ACTIVATE} && python -c 'import pytest, os; open(pytest.__file__, \"a\").write(\"#\")'")
        assert r.exit_code != 0 and "PermissionError" in r.output, r.output
        assert env.intact()
    finally:
        first.close()
        second.close()

    # a built environment changed from outside (here: a package removed) is rebuilt before the next grading
    shutil.rmtree(next(env.venv.glob("lib/python*/site-packages/iniconfig")))
    for d in env.venv.glob("lib/python*/site-packages/iniconfig-*.dist-info"):
        shutil.rmtree(d)
    assert not env.intact()
    third = backend.create(instance=two, repo_source=bundle_for(two))
    try:
        assert env.intact() and (env.path / ".complete").stat().st_mtime_ns != built_at
        assert third.exec(f"{ACTIVATE} && python -c 'import iniconfig'").exit_code == 0
    finally:
        third.close()


# --------------------------------------------------------------- tags: versions, and pruning all of them


def test_textkit_version_comes_from_tags_and_untagged_checkouts_are_caught(instances):
    row = instances["evalplane__textkit-2"]  # one commit after v1.1.0; v1.2.0 and v1.3.0 lie in the future
    sb = ProcessGrader().create(instance=row, repo_source=bundle_for(row))
    run = (f"{ACTIVATE} && python -m pip install -q -e . && python -c 'import textkit; print(textkit.__version__)' "
           "&& pytest -rA -p no:cacheprovider tests/test_slug.py")
    try:
        r = sb.exec(run)
        assert r.exit_code == 0, r.output
        assert r.output.splitlines()[0].startswith("1.1.1.dev1+g")
        # pruned as the official builder does it: tags after the base go, older ones stay
        r = sb.exec("git tag -d v1.2.0 v1.3.0 >/dev/null && " + run)
        assert r.exit_code == 0 and r.output.splitlines()[0].startswith("1.1.1.dev1+g"), r.output
        # pruned of every tag: the version falls back to 0.1.devN and the test suite refuses to run
        r = sb.exec("git tag -l | xargs git tag -d >/dev/null && " + run)
        assert r.exit_code == 4, r.output
        assert r.output.splitlines()[0].startswith("0.1.dev")
        assert "is not a tagged build" in r.output
    finally:
        sb.close()


# --------------------------------------------------------------------------------- the infra rule


def test_environment_that_cannot_run_the_tests_is_infra_error(instances, tmp_path):
    """A recipe without pytest: no valid test output with the gold patch, none on the untouched base either."""
    row = instances["evalplane__calc-2"]
    f = tmp_path / "broken.toml"
    good = RecipeBook.load(RECIPES).get("evalplane/calc", "0.2")
    f.write_text(synthetic_recipe(packages=good.requirements(drop=["pytest"])))
    backend = ProcessGrader(recipes=RecipeBook.load(f), env_root=tmp_path / "envs")
    logs = tmp_path / "logs"
    v = grade(make_job(row, run="broken-env"), row["patch"], logs, backend)
    assert v.outcome is EvalOutcome.INFRA_ERROR and not v.resolved, v
    assert v.report["infra_failure"] is True and v.report["infra_failure_reason"] == "environment_broken"
    assert v.report["patch_successfully_applied"] is False and not v.report["resolved"]
    d = instance_log_dir(logs, "broken-env", 1, "evalplane/demo-model", row["instance_id"])
    assert json.loads((d / "report.json").read_text()) == {row["instance_id"]: v.report}
    for name in ("test_output.txt", BASE_TEST_OUTPUT):
        assert "pytest: command not found" in (d / name).read_text()
    assert ">>>>> Applied Patch" not in (d / BASE_TEST_OUTPUT).read_text()  # the base ran without the patch
    rep = json.loads(write_run_report(
        {row["instance_id"]: {"instance_id": row["instance_id"], "model_name_or_path": "evalplane/demo-model",
                              "model_patch": row["patch"]}}, [row], "broken-env", logs).read_text())
    assert rep["infra_failure_ids"] == [row["instance_id"]] and rep["unresolved_ids"] == []
    assert rep["failure_reasons"] == {row["instance_id"]: "environment_broken"}


def test_patch_that_breaks_the_tests_stays_error(instances, tmp_path):
    """A patch that stops the suite from starting (the package no longer imports, so the conftest fails):
    no valid test output, but the untouched base gives some, so it is the patch's error."""
    row = instances["evalplane__textkit-1"]
    patch = patch_from_edits(row, [("textkit/__init__.py", "from textkit.slug import slugify\n",
                                    "from textkit.slug import slugify\nfrom textkit.missing import nothing\n")],
                             tmp_path)
    v = grade(make_job(row, run="breaks"), patch, tmp_path / "logs")
    assert v.outcome is EvalOutcome.ERROR and not v.resolved, v
    assert v.report["patch_successfully_applied"] is False and v.report["infra_failure"] is False
    d = instance_log_dir(tmp_path / "logs", "breaks", 1, "evalplane/demo-model", row["instance_id"])
    assert "ImportError while loading conftest" in (d / "test_output.txt").read_text()
    assert "PASSED tests/test_slug.py::test_slugify_single_word" in (d / BASE_TEST_OUTPUT).read_text()
    assert sorted(p.name for p in d.iterdir()) == sorted((*LOG_FILES, BASE_TEST_OUTPUT))
