"""Graders by name (eval_worker.graders): a grader kept outside the project, named by its dotted path, is the one
grading.grade, the worker and the CLI use; an unknown name is refused naming the choices. Needs no service."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import ClassVar

import pytest
from ew_helpers import make_job

from contract.models import EvalJob, EvalOutcome, Verdict, utcnow
from eval_worker.__main__ import _grader_name
from eval_worker.docker_backend import DockerGrader
from eval_worker.graders import GRADERS, Grader, GraderOptions, UnknownName, grader_name, resolve_grader
from eval_worker.grading import grade
from eval_worker.process_grader import ProcessGrader
from eval_worker.worker import EvalWorker

RECORDING = f"{__name__}:RecordingGrader"


class RecordingGrader(Grader):
    """Answers every job unresolved, and remembers what it was asked."""

    calls: ClassVar[list[tuple[EvalJob, str, Path]]] = []
    built_with: ClassVar[list[GraderOptions]] = []

    @classmethod
    def from_options(cls, options: GraderOptions) -> RecordingGrader:
        cls.built_with.append(options)
        return cls()

    def grade(self, job: EvalJob, patch: str, logs_root: str | Path) -> Verdict:
        self.calls.append((job, patch, Path(logs_root)))
        return Verdict(ref=job.ref, outcome=EvalOutcome.UNRESOLVED, resolved=False, reason="recorded",
                       started_at=utcnow(), ended_at=utcnow())


class NotAGrader:
    pass


@pytest.fixture
def recording():
    RecordingGrader.calls.clear()
    RecordingGrader.built_with.clear()
    return RecordingGrader


def _job() -> EvalJob:
    return make_job({"instance_id": "evalplane__calc-1"}, repo_source="unused.bundle")


def test_a_grader_by_dotted_path_is_the_one_grade_dispatches_to(recording, tmp_path):
    assert GRADERS.get(RECORDING) is RecordingGrader
    job = _job()
    verdict = grade(job, "diff --git a/x b/x\n", tmp_path, RECORDING)
    assert recording.calls == [(job, "diff --git a/x b/x\n", tmp_path)]
    assert verdict.ref == job.ref and verdict.outcome is EvalOutcome.UNRESOLVED and verdict.reason == "recorded"
    assert recording.built_with == [GraderOptions()]  # built from (default) options, as the worker builds one
    # an instance is used as it is; its records carry its name: here, its dotted path
    grader = RecordingGrader()
    assert resolve_grader(grader) is grader
    assert grader_name(RECORDING) == grader.name == RECORDING


def test_the_registered_graders(tmp_path):
    assert GRADERS.names() == ["docker", "process"]
    assert GRADERS.get("process") is ProcessGrader and GRADERS.get("docker") is DockerGrader
    assert grader_name("process") == "process" and grader_name(DockerGrader(client=object())) == "docker"
    options = GraderOptions(sandbox_root=tmp_path, keep_sandboxes=True)
    process = resolve_grader("process", options)
    assert isinstance(process, ProcessGrader) and (process.root, process.keep) == (tmp_path, True)
    assert isinstance(resolve_grader(None), ProcessGrader)  # the default
    assert ProcessGrader.needs_bundle and DockerGrader.needs_bundle is None


def test_the_worker_and_its_cli_take_a_grader_name(recording, tmp_path):
    worker = EvalWorker("http://unused/queue", tmp_path, grader=RECORDING)
    assert isinstance(worker.grader, RecordingGrader)
    assert _grader_name(RECORDING) == RECORDING and _grader_name("docker") == "docker"
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown grader 'dockr': one of docker, process"):
        _grader_name("dockr")


def test_an_unknown_grader_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(UnknownName, match=r"unknown grader 'nope': one of docker, process, or a dotted path"):
        grade(_job(), "diff --git a/x b/x\n", tmp_path, "nope")
    with pytest.raises(UnknownName, match=r"unknown grader 'nope'"):
        EvalWorker("http://unused/queue", tmp_path, grader="nope")
    with pytest.raises(UnknownName, match="is not a Grader subclass"):
        resolve_grader(f"{__name__}:NotAGrader")
    with pytest.raises(UnknownName, match="cannot be loaded"):
        resolve_grader(f"{__name__}:Missing")


def test_each_package_index_has_a_grading_network_of_its_own():
    """The grading network's egress relays to one index and is replaced when asked for other routes: gradings with
    another index, or none (a worker without one), go on networks of their own, never taking a running grading's."""
    from eval_worker.docker_backend import GRADING_NETWORK, grading_network

    a, b = "http://172.17.0.1:4597/index/", "http://172.17.0.1:4598/index/"
    names = {grading_network(a), grading_network(b), grading_network(None)}
    assert len(names) == 3 and all(n.startswith(GRADING_NETWORK + "-") for n in names)
    assert grading_network(a) == grading_network(a)  # the same index: one network, shared by the host's workers
    assert DockerGrader(client=object(), package_index=a).network == grading_network(a)
    assert DockerGrader(client=object()).network == grading_network(None) == f"{GRADING_NETWORK}-offline"
    assert DockerGrader(client=object(), package_index=a, network="mine").network == "mine"
