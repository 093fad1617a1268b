"""Gold validation on real images, recorded in the real PostgreSQL; the dispatcher's validated() API."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ew_helpers import ROOT, SYNTH

from eval_worker.docker_backend import DockerGrader
from eval_worker.pinning import ImageResolver
from eval_worker.records import ValidationRecord, validated
from eval_worker.validation import validate


@pytest.fixture
def no_records(database_url, instances):
    """Validation records are shared state of the session's database (the docker end-to-end test validates the
    synthetic set too): these tests start from none for the synthetic instances."""
    import psycopg

    with psycopg.connect(database_url) as conn:
        conn.execute("DELETE FROM image_validations WHERE instance_id = ANY(%s)", (list(instances),))


def test_validation_records_good_and_broken_images(no_records, pg, docker_client, instances, eval_images, broken_row, tmp_path):
    good = instances["evalplane__calc-2"]
    assert validated(pg, [good, broken_row]) == {good["instance_id"]: None, broken_row["instance_id"]: None}
    _records, errors = validate([good, broken_row], pg, grader=DockerGrader(client=docker_client),
                               logs_root=tmp_path, timeout_s=120)
    assert errors == []
    got = validated(pg, [good, broken_row])
    ok, bad = got[good["instance_id"]], got[broken_row["instance_id"]]
    assert ok.valid and ok.reason is None and ok.digest == eval_images[good["instance_id"]]
    assert ok.details["gold"]["outcome"] == "resolved"
    assert ok.details["base"]["tests_status"]["FAIL_TO_PASS"]["success"] == []  # F2P fail on the base
    assert not bad.valid and bad.digest == docker_client.images.get(broken_row["image"]).id
    # an environment that cannot run the tests is a finding about the image: recorded, invalid
    assert bad.reason.startswith("gold patch did not resolve: infra_error (environment_broken")
    assert bad.details["gold"]["report"]["infra_failure_reason"] == "environment_broken"
    # the record is per image: the official calc-1 image has no record yet
    assert validated(pg, [instances["evalplane__calc-1"]]) == {"evalplane__calc-1": None}
    # grading resolves a validated instance to the validated digest
    pinned = DockerGrader(client=docker_client, resolver=ImageResolver(os.environ["DATABASE_URL"])).pin(good)
    assert (pinned.ref, pinned.source) == (ok.digest, "validation")
    # and refuses to guess for an image without a valid record when pinning is required
    from eval_worker.pinning import ImageUnavailable
    with pytest.raises(ImageUnavailable):
        ImageResolver(os.environ["DATABASE_URL"], require_pinned=True).resolve(docker_client, broken_row)


def test_validate_cli_process_backend(no_records, database_url, instances, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "eval_worker", "validate", "--backend", "process", "--dataset",
         str(SYNTH / "instances.jsonl"), "--instances", "evalplane__textkit-1", "--logs-root", str(tmp_path),
         "--timeout", "60"],
        cwd=ROOT, env={**os.environ, "DATABASE_URL": database_url}, capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[0])
    assert out["instance_id"] == "evalplane__textkit-1" and out["valid"] and out["backend"] == "process"
    import psycopg

    with psycopg.connect(database_url) as conn:
        rec = validated(conn, [instances["evalplane__textkit-1"]], backend="process")["evalplane__textkit-1"]
        assert isinstance(rec, ValidationRecord) and rec.digest == out["digest"].replace("'", "")
        assert validated(conn, [instances["evalplane__textkit-1"]], backend="docker")["evalplane__textkit-1"] is None
