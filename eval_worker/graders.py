"""Graders by name: what a grading backend is (`Grader`), and the registry `GRADERS` that names them.

A grader takes an EvalJob and its patch and returns the Verdict, writing the official per-instance files under a
logs root; eval_worker.grading.grade dispatches to its `grade` and nothing else. One module per grader:

  process   eval_worker.process_grader.ProcessGrader   a confined local sandbox cloned from the instance's bundle
  docker    eval_worker.docker_backend.DockerGrader    the official run_instance in the instance image

A name that is not registered may be a dotted path "package.module:Class" to a Grader subclass kept elsewhere
(plumbing.registry); `--backend` of the worker and `eval.backend` of a spec take either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from plumbing.registry import Registry, UnknownName

if TYPE_CHECKING:
    from contract.models import EvalJob, Verdict

DEFAULT_GRADER = "process"


class GradingSandboxError(RuntimeError):
    """The place a grading runs (a sandbox folder, a container, its image) could not be prepared or used: an
    infrastructure failure, never the model's. `reason` becomes the verdict's infra_failure_reason."""

    def __init__(self, message: str, reason: str = "sandbox_unavailable"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class GraderOptions:
    """What the worker and the validate command know when they build a grader (their command-line options and
    environment); each grader reads the ones it uses."""

    database_url: str | None = None  # image validation and mirror records (docker)
    registry: str | None = None  # pull mirrored instance images by digest from here (docker)
    require_pinned: bool = False  # an image without a valid validation or mirror record is infra_error (docker)
    package_index: str | None = None  # the only network a grading may reach (docker)
    sandbox_root: Path | None = None  # where sandboxes go (process)
    keep_sandboxes: bool = False  # keep them after grading, for debugging (process)
    environments: tuple[Path, ...] = ()  # environment recipe files (process)


class ValidationSubject(NamedTuple):
    """What gold validation judges: `digest`, exactly what this grader grades the instance on (an image id, a hash
    of the bundle and environment), and `row`, the instance row to grade it with (pinned to that image)."""

    digest: str
    row: dict


class Grader(ABC):
    # the registered name, recorded with validations; a subclass that sets none is named by its dotted path
    name: ClassVar[str] = ""
    # why the grader needs each instance's git bundle (the dispatcher's plan refuses instances without one);
    # None: it grades without one
    needs_bundle: ClassVar[str | None] = None
    # its gradings install packages from the project's package index (eval_worker.package_index), their only network
    uses_package_index: ClassVar[bool] = False
    # its gradings run as the worker's child processes, so their CPU time is the worker's rusage of its children
    # (a grading in a container of the engine's is not: its CPU goes unrecorded)
    children_cpu: ClassVar[bool] = False

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if not cls.name:
            cls.name = f"{cls.__module__}:{cls.__qualname__}"

    @classmethod
    def from_options(cls, options: GraderOptions) -> Grader:
        """The grader the worker's (or validate's) options describe."""
        return cls()

    @classmethod
    def unavailable(cls) -> str | None:
        """Why graders of this kind cannot grade on this machine (the worker then refuses to start); None: they can."""
        return None

    @abstractmethod
    def grade(self, job: EvalJob, patch: str, logs_root: str | Path) -> Verdict:
        """Grade the (non-empty) `patch` for `job`, writing the official per-instance files under logs_root."""

    # gold validation (eval_worker.validation): graders that do not implement these cannot validate images

    def validation_subject(self, row: dict, repo_source: str) -> ValidationSubject:
        """What gold validation of `row` grades on. Raises GradingSandboxError when that cannot be known."""
        raise NotImplementedError(f"the {self.name} grader does not validate instances")

    def base_report(self, row: dict, repo_source: str, run: str, logs_root: Path, timeout_s: float) -> dict | None:
        """The instance's eval script on its untouched base (`row` as validation_subject gave it), graded: the
        official report entry, or None when it gave none (timed out or failed). Raises GradingSandboxError when the
        run could not be made."""
        raise NotImplementedError(f"the {self.name} grader does not validate instances")


GRADERS: Registry[type[Grader]] = Registry("grader", base=Grader)
GRADERS.register("process", "eval_worker.process_grader:ProcessGrader")
GRADERS.register("docker", "eval_worker.docker_backend:DockerGrader")


def resolve_grader(choice: str | Grader | None = None, options: GraderOptions | None = None) -> Grader:
    """`choice` itself when it is a grader; else the grader registered under that name (or at that dotted path),
    built from `options`. Raises UnknownName naming the choices."""
    if isinstance(choice, Grader):
        return choice
    return GRADERS.get(choice or DEFAULT_GRADER).from_options(options or GraderOptions())


def grader_name(choice: str | Grader) -> str:
    """The name a grader's records carry: its own for an instance, its class's for a registered name or dotted path."""
    return choice.name if isinstance(choice, Grader) else GRADERS.get(choice).name


__all__ = ["DEFAULT_GRADER", "GRADERS", "Grader", "GraderOptions", "GradingSandboxError", "UnknownName",
           "ValidationSubject", "grader_name", "resolve_grader"]
