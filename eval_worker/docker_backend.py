"""Grading with the official environment: swebench.harness.run_evaluation.run_instance, unmodified.

The instance image (pinned by digest, see eval_worker.pinning) becomes TestSpec.image; run_instance
creates the container, applies the patch with the official fallbacks, runs the instance's eval script
with its timeout, parses and writes the official files. It writes them relative to the CWD, so it runs
from the logs root under eval_worker.cwd's lock (one grading at a time per process).

run_instance returns a report or, on any failure, None; the verdict is read back from the files it
wrote (classify): a report -> resolved / unresolved / error (no valid test output); the official
"Timeout error: N seconds exceeded." -> timeout; ">>>>> Patch Apply Failed" -> apply_failed;
anything else (image missing, container or daemon errors) -> infra_error, never a model failure.
An error is checked against the untouched base (run_instance's skip_patch mode, in the same image):
no valid test output there either -> infra_error, reason environment_broken (eval_worker.grading).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import docker
from swebench.harness.constants import (
    APPLY_PATCH_FAIL,
    LOG_INSTANCE,
    LOG_REPORT,
    LOG_TEST_OUTPUT,
    RUN_EVALUATION_LOG_DIR,
)
from swebench.harness.grading import get_eval_report
from swebench.harness.utils import make_test_spec
from swebench.types import TestSpec

from contract.models import EvalJob, EvalOutcome, Verdict, utcnow
from eval_worker.cwd import in_directory
from eval_worker.grading import (
    ENVIRONMENT_BROKEN,
    ENVIRONMENT_BROKEN_REASON,
    environment_broken,
    infra_entry,
)
from eval_worker.layout import BASE_LOG_INSTANCE, BASE_TEST_OUTPUT, instance_log_dir, official_run_id
from eval_worker.pinning import ImageResolver, ImageUnavailable, PinnedImage

log = logging.getLogger("eval_worker.docker")


def container_name(instance_id: str, run_id: str) -> str:
    """The official name (run_evaluation.create_container)."""
    return f"sweb.eval.{instance_id.lower()}.{run_id}"


def remove_stale_containers(client: docker.DockerClient, instance_id: str, run_id: str) -> list[str]:
    """Remove containers a dead grading of the same (instance, run_id) left behind, including the
    official ghost-retry names "<name>.<epoch>"."""
    name = container_name(instance_id, run_id)
    removed = []
    for c in client.containers.list(all=True, filters={"name": name}):
        if c.name == name or c.name.startswith(name + "."):
            c.remove(force=True)
            removed.append(c.name)
    return removed


def timeout_arg(timeout_s: float) -> int | float:
    return int(timeout_s) if float(timeout_s).is_integer() else timeout_s


def classify(
    test_spec: TestSpec, pred: dict, result: tuple | None, log_dir: Path, timeout_s: float
) -> tuple[EvalOutcome, dict, str | None]:
    """(outcome, official report entry, reason) from run_instance's return value and files."""
    iid = test_spec.instance_id
    if result is not None:
        entry = result[1][iid]
        if entry["resolved"]:
            return EvalOutcome.RESOLVED, entry, None
        if not entry["patch_successfully_applied"]:
            why = entry.get("infra_failure_reason")
            return EvalOutcome.ERROR, entry, "no valid test output" + (f" ({why})" if why else "")
        return EvalOutcome.UNRESOLVED, entry, None
    out = log_dir / LOG_TEST_OUTPUT
    log_file = log_dir / LOG_INSTANCE
    log_text = log_file.read_text(errors="replace") if log_file.exists() else ""
    if out.exists() and out.read_text(errors="replace").endswith(
        f"\n\nTimeout error: {timeout_arg(timeout_s)} seconds exceeded."
    ):
        entry = get_eval_report(test_spec, pred, str(out), include_tests_status=True)[iid]
        return EvalOutcome.TIMEOUT, entry, f"tests timed out after {timeout_arg(timeout_s)} s"
    if APPLY_PATCH_FAIL in log_text:
        entry = get_eval_report(test_spec, pred, str(log_file), include_tests_status=True)[iid]
        return EvalOutcome.APPLY_FAILED, entry, APPLY_PATCH_FAIL
    errors = [ln for ln in log_text.splitlines() if " - ERROR - " in ln]
    why = errors[-1].split(" - ERROR - ", 1)[1] if errors else "run_instance failed without a report"
    kind = "image_missing" if "not found for" in log_text else "container_unavailable"
    return EvalOutcome.INFRA_ERROR, infra_entry(kind), f"docker: {why}"


class DockerBackend:
    """Grades in the instance's official image with the official run_instance."""

    name = "docker"

    def __init__(self, client: docker.DockerClient | None = None, resolver: ImageResolver | None = None):
        self._client = client
        self.resolver = resolver or ImageResolver()

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            from swebench.harness.run_evaluation import _docker_client

            self._client = _docker_client()
        return self._client

    def pin(self, row: dict) -> PinnedImage:
        return self.resolver.resolve(self.client, row)

    def run_official(
        self, test_spec: TestSpec, pred: dict, run_id: str, logs_root: str | Path, timeout_s: float,
        skip_patch: bool = False,
    ) -> tuple | None:
        """run_instance from logs_root, after removing stale containers of the same (instance, run)."""
        from swebench.harness.run_evaluation import run_instance

        stale = remove_stale_containers(self.client, test_spec.instance_id, run_id)
        if stale:
            log.warning("removed stale container(s) %s", stale)
        Path(logs_root).mkdir(parents=True, exist_ok=True)
        with in_directory(logs_root):
            return run_instance(
                test_spec, pred, self.client, run_id, timeout=timeout_arg(timeout_s), skip_patch=skip_patch
            )

    def grade(self, job: EvalJob, patch: str, logs_root: str | Path) -> Verdict:
        """Grade `patch` for `job` (non-empty; grading.grade checks) and return the Verdict."""
        started = utcnow()
        iid = job.ref.instance_id
        run_id = official_run_id(job.ref.run, job.ref.attempt)
        log_dir = instance_log_dir(logs_root, job.ref.run, job.ref.attempt, job.model_name, iid)
        if log_dir.exists():
            shutil.rmtree(log_dir)  # run_instance would return a stale report.json as is
        pred = {"instance_id": iid, "model_name_or_path": job.model_name, "model_patch": patch}

        def verdict(outcome: EvalOutcome, entry: dict, reason: str | None) -> Verdict:
            return Verdict(ref=job.ref, outcome=outcome, resolved=outcome is EvalOutcome.RESOLVED,
                           report=entry, reason=reason, started_at=started, ended_at=utcnow())

        def infra(kind: str, why: str) -> Verdict:
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / "patch.diff").write_text(patch)
            (log_dir / LOG_INSTANCE).write_text(f"{utcnow().isoformat()} - ERROR - {why}\n")
            return verdict(EvalOutcome.INFRA_ERROR, infra_entry(kind), why)

        try:
            if job.instance.get("instance_id") != iid:
                raise ValueError(f"instance row is for {job.instance.get('instance_id')!r}, job is for {iid!r}")
            make_test_spec(job.instance)
        except (KeyError, ValueError, TypeError) as e:
            return infra("bad_instance_row", f"bad instance row: {e!r}")
        try:
            self.client.ping()
            pinned = self.pin(job.instance)
        except ImageUnavailable as e:
            return infra("image_missing", f"image: {e}")
        except (docker.errors.DockerException, OSError) as e:
            return infra("container_unavailable", f"docker daemon: {e}")
        test_spec = make_test_spec({**job.instance, "image": pinned.ref})
        log.info("%s: grading on %s (%s)", job.ref.slug, pinned.ref, pinned.source)
        try:
            result = self.run_official(test_spec, pred, run_id, logs_root, job.timeout_s)
        except (docker.errors.DockerException, OSError) as e:  # e.g. listing stale containers failed
            return infra("container_unavailable", f"docker: {e}")
        outcome, entry, reason = classify(test_spec, pred, result, log_dir, job.timeout_s)
        if outcome is EvalOutcome.ERROR:
            try:
                base_valid = self.run_on_base(test_spec, run_id, log_dir, job.timeout_s)
            except (docker.errors.DockerException, OSError) as e:
                return infra("container_unavailable", f"docker (base check): {e}")
            if not base_valid:
                entry = environment_broken(entry)
                (log_dir / LOG_REPORT).write_text(json.dumps({iid: entry}, indent=4))
                log.info("%s: %s", job.ref.slug, ENVIRONMENT_BROKEN)
                return verdict(EvalOutcome.INFRA_ERROR, entry, ENVIRONMENT_BROKEN_REASON)
        return verdict(outcome, entry, reason)

    def run_on_base(self, test_spec: TestSpec, run_id: str, log_dir: Path, timeout_s: float) -> bool:
        """run_instance(skip_patch=True) in the same image; its test output and log go beside the graded
        run's as base_test_output.txt / base_run_instance.log. True iff it gave valid test output."""
        iid = test_spec.instance_id
        pred = {"instance_id": iid, "model_name_or_path": "base", "model_patch": ""}
        with tempfile.TemporaryDirectory(prefix="ep-base-check-") as tmp:
            result = self.run_official(test_spec, pred, run_id, tmp, timeout_s, skip_patch=True)
            files = Path(tmp) / RUN_EVALUATION_LOG_DIR / run_id / "base" / iid
            for src, dst in ((LOG_TEST_OUTPUT, BASE_TEST_OUTPUT), (LOG_INSTANCE, BASE_LOG_INSTANCE)):
                if (files / src).is_file():
                    shutil.copyfile(files / src, log_dir / dst)
        return result is not None and bool(result[1][iid]["patch_successfully_applied"])
