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

The container runs the model's code (the tests import the patched package), so run_instance is handed a Docker
client that seals every container it creates (SealedDocker; run_instance itself stays unmodified): on the grading
network, an internal network whose only peer is an egress relaying to the package index (eval_worker.package_index)
and whose bridge has no address on the host, so nothing of the control plane, the host or the metadata addresses
is reachable; pip pointed at that index; without the CAP_SYS_ADMIN run_instance adds (for browser sandboxes in
JavaScript instances: it lets root in the container mount filesystems); with no-new-privileges. An eval script that
installs packages while the index is down lands infra_error (package_index_unavailable), never the model's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

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
from eval_worker import package_index
from eval_worker.cwd import in_directory
from eval_worker.environments import installs_packages
from eval_worker.graders import Grader, GraderOptions, GradingSandboxError, ValidationSubject
from eval_worker.grading import (
    ENVIRONMENT_BROKEN,
    ENVIRONMENT_BROKEN_REASON,
    environment_broken,
    infra_entry,
)
from eval_worker.layout import (
    BASE_LOG_INSTANCE,
    BASE_TEST_OUTPUT,
    EMPTY_MODEL,
    instance_log_dir,
    official_run_id,
)
from eval_worker.pinning import ImageResolver, ImageUnavailable, PinnedImage
from plumbing.egress import EGRESS_IMAGE, EGRESS_IMAGE_ENV, Egress, EgressError

log = logging.getLogger("eval_worker.docker")

GRADING_NETWORK = "evalplane-grading"
DROPPED_CAPS = {"SYS_ADMIN"}


class ContainerCpu:
    """CPU-seconds of each container a grading creates, from Docker's stats stream while it lives: run_instance
    removes the container before it returns, and its cgroup's counters go with it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._watches: dict[str, list[tuple[threading.Thread, dict]]] = {}

    def watch(self, container) -> None:
        last: dict = {}

        def follow() -> None:
            try:  # the stream samples about once a second and ends when the container is removed
                for sample in container.stats(stream=True, decode=True):
                    ns = (sample.get("cpu_stats") or {}).get("cpu_usage", {}).get("total_usage") or 0
                    if ns:
                        last["ns"] = ns
            except (docker.errors.DockerException, OSError, ValueError):
                pass

        thread = threading.Thread(target=follow, name=f"cpu-{container.name}", daemon=True)
        thread.start()
        with self._lock:
            self._watches.setdefault(container.name, []).append((thread, last))

    def take(self, name: str, wait_s: float = 10.0) -> float | None:
        """The CPU-seconds of every container named `name` since the last take (None: none was seen running)."""
        with self._lock:
            watches = self._watches.pop(name, [])
        for thread, _ in watches:
            thread.join(wait_s)
        seen = [last["ns"] for _, last in watches if "ns" in last]
        return round(sum(seen) / 1e9, 6) if seen else None


class SealedContainers:
    """client.containers, whose create() seals every container (SealedDocker) and meters its CPU."""

    def __init__(self, containers, seal, cpu: ContainerCpu):
        self._containers, self._seal, self._cpu = containers, seal, cpu

    def create(self, image, command=None, **kwargs):
        container = self._containers.create(image, command, **self._seal(kwargs))
        self._cpu.watch(container)
        return container

    def __getattr__(self, name):
        return getattr(self._containers, name)


class SealedDocker:
    """The Docker client run_instance is handed: the real one, but every container it creates goes on `network`,
    with `environment` added, without DROPPED_CAPS and with no-new-privileges."""

    def __init__(self, client: docker.DockerClient, network: str, environment: dict[str, str]):
        self._client, self.network, self.environment = client, network, environment
        self.cpu = ContainerCpu()
        self.containers = SealedContainers(client.containers, self.seal, self.cpu)

    def seal(self, kwargs: dict) -> dict:
        kw = {k: v for k, v in kwargs.items() if k not in ("network_mode", "network", "networking_config")}
        env = kw.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        kw["environment"] = {**env, **self.environment}
        kw["cap_add"] = [c for c in kw.get("cap_add") or [] if c.upper().removeprefix("CAP_") not in DROPPED_CAPS]
        kw["security_opt"] = [*(kw.get("security_opt") or []), "no-new-privileges"]
        kw["network"] = self.network
        return kw

    def __getattr__(self, name):
        return getattr(self._client, name)


INDEX_DOWN = "package_index_unavailable"


def grading_network(package_index: str | None) -> str:
    """The grading network for gradings that reach `package_index` (None: nothing): one per index, since its egress
    relays to that index alone and is replaced when asked for other routes, so that gradings with another index, or
    none, never take away the egress of one running."""
    if not package_index:
        return f"{GRADING_NETWORK}-offline"
    return f"{GRADING_NETWORK}-{hashlib.sha1(package_index.encode()).hexdigest()[:8]}"


def _up(egress: Egress) -> Egress:
    """The grading network and its egress (shared by every worker on the host: one that lost a race to create
    them finds the winner's)."""
    for attempt in range(3):
        try:
            return egress.up()
        except docker.errors.APIError as e:
            if e.status_code != 409 or attempt == 2:
                raise
    raise AssertionError("unreachable")


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


class DockerGrader(Grader):
    """Grades in the instance's official image with the official run_instance."""

    name = "docker"
    uses_package_index = True

    def __init__(self, client: docker.DockerClient | None = None, resolver: ImageResolver | None = None,
                 package_index: str | None = None, network: str | None = None, egress_image: str | None = None):
        """package_index: the simple-API URL of the index gradings may reach (None: they reach nothing). network:
        default grading_network(package_index)."""
        self._client = client
        self.resolver = resolver or ImageResolver()
        self.package_index = package_index
        self.network = network or grading_network(package_index)
        self.egress_image = egress_image or os.environ.get(EGRESS_IMAGE_ENV) or EGRESS_IMAGE
        self._sealed: SealedDocker | None = None

    @classmethod
    def from_options(cls, options: GraderOptions) -> DockerGrader:
        if not options.package_index:
            logging.getLogger("eval_worker").warning(
                "no package index (--package-index, $%s): gradings reach no network; an eval script that installs "
                "packages from an index fails", package_index.PACKAGE_INDEX_ENV)
        return cls(resolver=ImageResolver(options.database_url, options.registry, options.require_pinned),
                   package_index=options.package_index)

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            from swebench.harness.run_evaluation import _docker_client

            self._client = _docker_client()
        return self._client

    @property
    def sealed_client(self) -> SealedDocker:
        """The client run_instance gets; the grading network is set up on first use."""
        if self._sealed is None:
            allowed = [self.package_index] if self.package_index else []
            egress = _up(Egress(self.client, self.network, allowed, self.egress_image, host_address=False))
            env = {}
            if self.package_index:
                index = egress.url(self.package_index)
                env = {"PIP_INDEX_URL": index, "PIP_TRUSTED_HOST": urlsplit(index).hostname or "",
                       "PIP_DEFAULT_TIMEOUT": "120"}  # the index may fetch a large file whole before sending it
            self._sealed = SealedDocker(self.client, self.network, env)
        return self._sealed

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
                test_spec, pred, self.sealed_client, run_id, timeout=timeout_arg(timeout_s), skip_patch=skip_patch
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
            cpu = self._sealed.cpu.take(container_name(iid, run_id)) if self._sealed else None
            return Verdict(ref=job.ref, outcome=outcome, resolved=outcome is EvalOutcome.RESOLVED,
                           report=entry, reason=reason, started_at=started, ended_at=utcnow(), grading_cpu_s=cpu)

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
            self.sealed_client  # noqa: B018  (the grading network, before anything runs)
        except ImageUnavailable as e:
            return infra("image_missing", f"image: {e}")
        except EgressError as e:
            return infra("container_unavailable", f"grading network: {e}")
        except (docker.errors.DockerException, OSError) as e:
            return infra("container_unavailable", f"docker daemon: {e}")
        needs_index = bool(self.package_index) and bool(installs_packages(job.instance["eval_script"]))
        if needs_index and not package_index.available(self.package_index):
            return infra(INDEX_DOWN, f"the eval script installs packages and the package index "
                                     f"{self.package_index} does not answer")
        test_spec = make_test_spec({**job.instance, "image": pinned.ref})
        log.info("%s: grading on %s (%s)", job.ref.slug, pinned.ref, pinned.source)
        try:
            result = self.run_official(test_spec, pred, run_id, logs_root, job.timeout_s)
        except (docker.errors.DockerException, OSError) as e:  # e.g. listing stale containers failed
            return infra("container_unavailable", f"docker: {e}")
        outcome, entry, reason = classify(test_spec, pred, result, log_dir, job.timeout_s)
        if needs_index and outcome is not EvalOutcome.RESOLVED and not package_index.available(self.package_index):
            # the index went away while the eval script ran: what the tests then said is not the model's
            return infra(INDEX_DOWN, f"the package index {self.package_index} stopped answering during grading")
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

    # ------------------------------------------------------------------ gold validation

    def validation_subject(self, row: dict, repo_source: str) -> ValidationSubject:
        """The image the instance grades on, by image id, and the row pinned to it."""
        try:
            pinned = self.pin(row)
        except ImageUnavailable as e:
            raise GradingSandboxError(str(e), reason="image_missing") from e
        try:
            try:
                digest = self.client.images.get(pinned.ref).id
            except docker.errors.ImageNotFound:
                digest = self.client.images.pull(pinned.ref).id  # a mirror reference: by digest
        except docker.errors.DockerException as e:
            raise GradingSandboxError(f"{pinned.ref}: {e}", reason="container_unavailable") from e
        return ValidationSubject(digest, {**row, "image": pinned.ref})

    def base_report(self, row: dict, repo_source: str, run: str, logs_root: Path, timeout_s: float) -> dict | None:
        """The eval script on the untouched base image via run_instance(skip_patch=True): its report entry."""
        ts = make_test_spec(row)
        pred = {"instance_id": row["instance_id"], "model_name_or_path": EMPTY_MODEL, "model_patch": ""}
        result = self.run_official(ts, pred, run, logs_root, timeout_s, skip_patch=True)
        return result[1][row["instance_id"]] if result else None
