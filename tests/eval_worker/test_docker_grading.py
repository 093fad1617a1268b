"""The docker backend: the unmodified official run_instance in the synthetic instances' eval images,
on a real Docker engine; and the same verdicts from the process backend."""

from __future__ import annotations

import json

import docker
import pytest
from ew_helpers import make_job, patch_from_edits
from test_grading import NON_APPLYING

from contract.models import EvalOutcome, Verdict
from eval_worker.docker_backend import DockerGrader, container_name, remove_stale_containers
from eval_worker.grading import grade, infra_entry
from eval_worker.layout import (
    BASE_LOG_INSTANCE,
    BASE_TEST_OUTPUT,
    LOG_FILES,
    instance_log_dir,
    official_run_id,
)
from eval_worker.process_grader import ProcessGrader

MODEL = "evalplane/demo-model"


def _containers(client, iid: str, run_id: str) -> list[str]:
    name = container_name(iid, run_id)
    return [c.name for c in client.containers.list(all=True, filters={"name": name})]


BREAKS_IMPORT = [("textkit/__init__.py", "from textkit.slug import slugify\n",
                  "from textkit.slug import slugify\nfrom textkit.missing import nothing\n")]


@pytest.fixture(scope="module")
def cases(instances, demo_policy, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """case -> (instance_id, patch): every gold patch, the demo model's wrong patch, a non-applying one, and
    one that stops the test suite from starting (the package no longer imports)."""
    out = {f"gold:{iid}": (iid, row["patch"]) for iid, row in instances.items()}
    wrong = next(i for i, a in demo_policy["instances"].items() if a["action"] == "patch")
    out[f"wrong:{wrong}"] = (wrong, demo_policy["instances"][wrong]["patch"])
    out["noapply:evalplane__textkit-3"] = ("evalplane__textkit-3", NON_APPLYING)
    out["breaks:evalplane__textkit-1"] = ("evalplane__textkit-1", patch_from_edits(
        instances["evalplane__textkit-1"], BREAKS_IMPORT, tmp_path_factory.mktemp("breaks")))
    return out


@pytest.fixture(scope="module")
def logs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("docker-logs")


@pytest.fixture(scope="module")
def docker_verdicts(eval_images, docker_client, cases, instances, logs_root, unique_run) -> dict[str, Verdict]:
    backend = DockerGrader(client=docker_client)
    return {case: grade(make_job(instances[iid], run=f"{unique_run}-{case.split(':')[0]}", model=MODEL),
                        patch, logs_root, backend)
            for case, (iid, patch) in cases.items()}


@pytest.fixture(scope="module")
def unique_run():
    import uuid

    return f"dk{uuid.uuid4().hex[:8]}"


def test_gold_resolves_in_the_official_environment(docker_verdicts, instances, logs_root, unique_run):
    for iid, row in instances.items():
        v = docker_verdicts[f"gold:{iid}"]
        assert v.outcome is EvalOutcome.RESOLVED and v.resolved, v
        assert v.report["tests_status"]["FAIL_TO_PASS"]["success"] == json.loads(row["FAIL_TO_PASS"])
        d = instance_log_dir(logs_root, f"{unique_run}-gold", 1, MODEL, iid)
        assert sorted(p.name for p in d.iterdir()) == sorted(LOG_FILES)  # official layout, official names
        assert json.loads((d / "report.json").read_text()) == {iid: v.report}
        assert v.report["infra_failure"] is False  # v5 field present
        assert v.grading_cpu_s is not None and v.grading_cpu_s > 0, v  # the grading container's, from Docker
        log = (d / "run_instance.log").read_text()
        assert "Container for " + iid + " created" in log and ">>>>> Applied Patch" in log


def test_wrong_patch_is_unresolved(docker_verdicts):
    v = docker_verdicts["wrong:evalplane__calc-1"]
    assert v.outcome is EvalOutcome.UNRESOLVED and not v.resolved
    assert v.report["patch_successfully_applied"] and v.report["tests_status"]["FAIL_TO_PASS"]["failure"]


def test_non_applying_patch_is_official_apply_failure(docker_verdicts, logs_root, unique_run):
    v = docker_verdicts["noapply:evalplane__textkit-3"]
    assert v.outcome is EvalOutcome.APPLY_FAILED and not v.resolved
    assert v.report["patch_successfully_applied"] is False and v.report["infra_failure"] is False
    d = instance_log_dir(logs_root, f"{unique_run}-noapply", 1, MODEL, "evalplane__textkit-3")
    log = (d / "run_instance.log").read_text()
    assert ">>>>> Patch Apply Failed" in log
    for cmd in ("git apply --verbose", "git apply --verbose --3way", "git apply --verbose --reject",
                "patch --batch --forward --fuzz=5 -p1 -i"):
        assert f"Failed to apply patch to container: {cmd}\n" in log
    assert not (d / "report.json").exists() and not (d / "test_output.txt").exists()


def test_patch_that_breaks_the_tests_is_error_not_infra(docker_verdicts, logs_root, unique_run):
    """No valid test output with the patch, valid output from run_instance's skip_patch run on the same
    image: the patch broke the test run."""
    v = docker_verdicts["breaks:evalplane__textkit-1"]
    assert v.outcome is EvalOutcome.ERROR and not v.resolved, v
    assert v.report["patch_successfully_applied"] is False and v.report["infra_failure"] is False
    d = instance_log_dir(logs_root, f"{unique_run}-breaks", 1, MODEL, "evalplane__textkit-1")
    assert "ImportError while loading conftest" in (d / "test_output.txt").read_text()
    base = (d / BASE_TEST_OUTPUT).read_text()
    assert "PASSED tests/test_slug.py::test_slugify_single_word" in base and "Python 3.9" in base
    assert "Applied Patch" not in (d / BASE_LOG_INSTANCE).read_text()  # skip_patch: the untouched base


def test_broken_environment_is_infra_error(broken_row, docker_client, tmp_path):
    """The gold patch on the deliberately broken image (no pytest in testbed): no valid test output with the
    patch nor on the untouched base -> infra_error, the official report entry's infra fields set."""
    iid = broken_row["instance_id"]
    v = grade(make_job(broken_row, run="brokenimg", model=MODEL), broken_row["patch"], tmp_path,
              DockerGrader(client=docker_client))
    assert v.outcome is EvalOutcome.INFRA_ERROR and not v.resolved, v
    assert v.report["infra_failure"] is True and v.report["infra_failure_reason"] == "environment_broken"
    d = instance_log_dir(tmp_path, "brokenimg", 1, MODEL, iid)
    assert json.loads((d / "report.json").read_text()) == {iid: v.report}
    for name in ("test_output.txt", BASE_TEST_OUTPUT):
        assert "pytest: command not found" in (d / name).read_text()
    assert ">>>>> Applied Patch" in (d / "run_instance.log").read_text()
    assert ">>>>> Applied Patch" not in (d / BASE_LOG_INSTANCE).read_text()


def test_process_and_docker_backends_agree(docker_verdicts, cases, instances, tmp_path):
    for case, (iid, patch) in cases.items():
        p = grade(make_job(instances[iid], run="parity", model=MODEL), patch, tmp_path, ProcessGrader())
        d = docker_verdicts[case]
        assert (p.outcome, p.resolved) == (d.outcome, d.resolved), case
        assert p.report.get("tests_status") == d.report.get("tests_status"), case


def test_empty_patch_is_never_graded(eval_images, docker_client, instances, tmp_path):
    row = instances["evalplane__textkit-2"]
    job = make_job(row, run="emptyrun")
    for patch in ("", "\n", None):
        with pytest.raises(ValueError):
            grade(job, patch, tmp_path, DockerGrader(client=docker_client))
    assert not (tmp_path / "logs").exists()
    assert _containers(docker_client, row["instance_id"], "emptyrun") == []


def test_endless_tests_time_out(eval_images, docker_client, instances, tmp_path, unique_run):
    row = instances["evalplane__calc-1"]
    patch = patch_from_edits(row, [("calc/stats.py", "    mid = len(ordered) // 2\n",
                                    "    while True:\n        pass\n    mid = len(ordered) // 2\n")], tmp_path)
    run = f"{unique_run}-loop"
    # long enough for the eval script's `pip install -e .` to finish and the tests to start looping
    v = grade(make_job(row, run=run, timeout_s=20), patch, tmp_path / "root", DockerGrader(client=docker_client))
    assert v.outcome is EvalOutcome.TIMEOUT and not v.resolved, v
    assert v.report["infra_failure_reason"] == "tests_timed_out"  # the official v5 classification
    d = instance_log_dir(tmp_path / "root", run, 1, MODEL, row["instance_id"])
    assert (d / "test_output.txt").read_text().endswith("\n\nTimeout error: 20 seconds exceeded.")
    assert not (d / "report.json").exists()
    assert _containers(docker_client, row["instance_id"], run) == []  # official cleanup ran


def test_missing_image_is_infra_error(eval_images, docker_client, instances, tmp_path):
    row = {**instances["evalplane__calc-2"], "image": "evalplane-test/no-such-image:latest"}
    v = grade(make_job(row, run="noimage"), row["patch"], tmp_path, DockerGrader(client=docker_client))
    assert v.outcome is EvalOutcome.INFRA_ERROR and not v.resolved
    assert v.report == infra_entry("image_missing") and "not found locally" in v.reason
    assert v.grading_cpu_s is None  # no container ran


def test_unreachable_daemon_is_infra_error(instances, tmp_path):
    row = instances["evalplane__calc-2"]
    dead = docker.DockerClient(base_url=f"unix://{tmp_path}/no-docker.sock", version="1.41")
    v = grade(make_job(row, run="nodaemon"), row["patch"], tmp_path, DockerGrader(client=dead))
    assert v.outcome is EvalOutcome.INFRA_ERROR and v.report["infra_failure_reason"] == "container_unavailable"


def test_grading_uses_the_image_digest_and_removes_stale_containers(eval_images, docker_client, instances, tmp_path):
    row = instances["evalplane__calc-2"]
    backend = DockerGrader(client=docker_client)
    pinned = backend.pin(row)
    assert pinned.ref == eval_images[row["instance_id"]] and pinned.ref.startswith("sha256:")
    run_id = official_run_id("stale", 2)
    # a container a killed worker left behind, under the official ghost-retry name too
    leftovers = [docker_client.containers.run(pinned.ref, "tail -f /dev/null", detach=True,
                                              name=container_name(row["instance_id"], run_id) + suffix)
                 for suffix in ("", ".1700000000")]
    v = grade(make_job(row, run="stale", attempt=2), row["patch"], tmp_path, backend)
    assert v.outcome is EvalOutcome.RESOLVED
    assert _containers(docker_client, row["instance_id"], run_id) == []
    for c in leftovers:
        with pytest.raises(docker.errors.NotFound):
            c.reload()
    assert remove_stale_containers(docker_client, row["instance_id"], run_id) == []
