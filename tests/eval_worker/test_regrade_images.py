"""`regrade --images`: a run's recorded patch graded again by the docker grader in the image named for its instance
(by digest), the new verdict recorded beside the first with that digest."""

from __future__ import annotations

import pytest

from contract.models import AttemptRef
from dispatcher import regrade
from eval_worker.docker_backend import DockerGrader
from tests.dispatcher.test_regrade import first_verdicts, graded_run

pytestmark = pytest.mark.docker


def test_regrade_on_images_grades_again_in_the_given_digest(docker_client, eval_images, tmp_path, unique, pg,
                                                            database_url, moto_endpoint):
    iid = "evalplane__calc-1"
    # its gold patch, recorded as unresolved (a grading in a broken image failed a test it fixes)
    plan, res = graded_run(tmp_path, unique, pg, {iid: {"tests/test_stats.py::test_median_even"}})
    first = first_verdicts(pg, unique)
    assert [s for _, s, _, _ in first] == ["UNRESOLVED"]
    digest = eval_images[iid]
    assert digest.startswith("sha256:")

    done = regrade.on_images(pg, plan, {iid: digest}, lambda ref: res.artifacts_prefix(ref),
                             DockerGrader(client=docker_client), tmp_path / "logs", 300)
    assert [(r.ref, r.before, r.after) for r in done] == [
        (AttemptRef(run=unique, instance_id=iid, attempt=1), "UNRESOLVED", "RESOLVED")]
    [change] = regrade.changes(pg, unique)
    assert (change["first"], change["latest"], change["how"], change["image_digest"]) == (
        "UNRESOLVED", "RESOLVED", "images", digest)
    assert first_verdicts(pg, unique) == first  # the first verdict is kept as it was
