"""The process grader: grades on this machine, without Docker, in a confined sandbox (eval_worker.sandbox).

The steps, files and markers follow swebench.harness.run_evaluation.run_instance (swebench 5.0.2), with the
container calls going to a ProcessSandbox: a per-grading folder holding the repository cloned from the job's
repo_source (a git bundle or repository path) at its base commit, and a private copy of the instance's
(repo, version) environment built from its recipe (eval_worker.environments), never the worker's own Python.
Grading itself is swebench's own get_eval_report (include_tests_status=True); the outcomes are those of
eval_worker.grading.

An instance without a recipe runs with the worker's Python on PATH (its virtualenv and interpreter, read-only)
only if its eval script installs nothing; one that installs packages is refused (GradingSandboxError, reason
environment_unavailable).

Limitation: the environment is rebuilt from a recipe, not the instance image's (the docker grader gives the
official results).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from swebench.harness.constants import (
    APPLY_PATCH_FAIL,
    APPLY_PATCH_PASS,
    CONTAINER_PATCH_FILE,
    LOG_INSTANCE,
    LOG_REPORT,
    LOG_TEST_OUTPUT,
)
from swebench.harness.grading import get_eval_report, get_logs_eval
from swebench.harness.run_evaluation import GIT_APPLY_CMDS
from swebench.harness.utils import make_test_spec

from contract.models import EvalJob, EvalOutcome, Verdict, utcnow
from eval_worker.environments import (
    RECIPES_FILE,
    GradingEnvironmentError,
    ProcessEnvironment,
    RecipeBook,
    installs_packages,
    process_environment,
    recipes_near,
)
from eval_worker.graders import Grader, GraderOptions, GradingSandboxError, ValidationSubject
from eval_worker.grading import (
    ENVIRONMENT_BROKEN,
    ENVIRONMENT_BROKEN_REASON,
    environment_broken,
    infra_entry,
    timeout_text,
)
from eval_worker.layout import BASE_TEST_OUTPUT, EMPTY_MODEL, instance_log_dir
from eval_worker.sandbox import (
    CONTAINER_CONDA_ROOT,
    GRADER_USER,
    ProcessSandbox,
    Sandbox,
    confinement_problem,
)
from plumbing import system_user

RESET_CMD = "git checkout -- . ; git clean -fd"


def _instance_logger(log_file: Path) -> logging.Logger:
    """Like swebench.logger.setup_logger, but unique per log file (attempts may grade concurrently)."""
    logger = logging.getLogger(f"eval_worker.instance.{log_file}")
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    handler = logging.FileHandler(log_file, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def _close_logger(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()


def apply_patch(sandbox: Sandbox, logger: logging.Logger) -> tuple[bool, str]:
    """The official apply chain: GIT_APPLY_CMDS in order, resetting between tries, then the
    "already applied" reverse check. Returns (applied, output of the last try)."""
    output = ""
    for attempt, git_apply_cmd in enumerate(GIT_APPLY_CMDS):
        if attempt:
            sandbox.exec(RESET_CMD)
        res = sandbox.exec(f"{git_apply_cmd} {CONTAINER_PATCH_FILE}")
        output = res.output
        if res.exit_code == 0:
            logger.info(f"{APPLY_PATCH_PASS}:\n{res.output}")
            return True, output
        logger.info(f"Failed to apply patch to container: {git_apply_cmd}")
    reverse = sandbox.exec(f"git apply --check --reverse {CONTAINER_PATCH_FILE}")
    if reverse.exit_code == 0:
        logger.info(f"{APPLY_PATCH_PASS}: verified already applied")
        return True, output
    return False, output


class ProcessGrader(Grader):
    """Grades in sandboxes that are local directories and confined processes (machines without Docker).

    recipes: environment recipes by (repo, version), in addition to the `environments.toml` beside each
    job's repository bundle; env_root: where the environments are built (default <state dir>/grading-envs);
    pythons: the interpreters recipes may use (default: those on PATH, never the worker's own).
    """

    name = "process"
    children_cpu = True
    needs_bundle = "the process grading backend grades in a clone of its git bundle"

    def __init__(self, root: str | Path | None = None, keep: bool = False, clone_timeout: float = 300.0,
                 recipes: RecipeBook | None = None, env_root: str | Path | None = None,
                 pythons: list[str] | None = None):
        self.root = Path(root) if root else None
        self.keep = keep
        self.clone_timeout = clone_timeout
        self.recipes = recipes or RecipeBook()
        self.env_root = Path(env_root) if env_root else None
        self.pythons = pythons
        self._environments: dict[str, ProcessEnvironment] = {}

    @classmethod
    def from_options(cls, options: GraderOptions) -> ProcessGrader:
        """Raises GradingEnvironmentError naming a recipe file that cannot be read."""
        recipes = RecipeBook()
        for p in options.environments:
            recipes = recipes.merged(RecipeBook.load(p))
        return cls(root=options.sandbox_root, keep=options.keep_sandboxes, recipes=recipes)

    @classmethod
    def unavailable(cls) -> str | None:
        return confinement_problem()

    def environment(self, instance: dict, repo_source: str) -> ProcessEnvironment | None:
        """The instance's (repo, version) environment (not yet built or locked), or None without a recipe.
        Raises GradingSandboxError (environment_unavailable) when there is none and the eval script installs
        packages, or when the recipe cannot be used here."""
        repo, version = instance["repo"], str(instance["version"])
        try:
            book = self.recipes.merged(recipes_near(repo_source)) if "://" not in repo_source else self.recipes
            recipe = book.get(repo, version)
            if recipe is None:
                installs = installs_packages(instance["eval_script"])
                if installs:
                    where = ", ".join(book.sources) or f"no {RECIPES_FILE} beside {repo_source}"
                    raise GradingSandboxError(
                        f"{instance['instance_id']}: no environment recipe for {repo} {version} ({where}), and its "
                        f"eval script installs packages ({installs[0]!r}): refusing to run it in the worker's "
                        f"own environment", reason="environment_unavailable")
                return None
            key = recipe.digest()  # one environment per recipe, whichever of its versions
            if key not in self._environments:
                self._environments[key] = process_environment(recipe, root=self.env_root, pythons=self.pythons)
            return self._environments[key]
        except GradingEnvironmentError as e:
            raise GradingSandboxError(f"{instance['instance_id']}: {e}", reason="environment_unavailable") from e

    def create(self, *, instance: dict, repo_source: str) -> ProcessSandbox:
        """A fresh sandbox for the instance row: its repository checked out at base_commit in /testbed, in the
        instance's environment. Raises GradingSandboxError when that cannot be done (clone failure, missing
        commit, no environment...)."""
        iid, base_commit = instance["instance_id"], instance["base_commit"]
        src = repo_source
        if "://" not in src:
            if not Path(src).exists():
                raise GradingSandboxError(f"repo_source does not exist: {src}")
            src = str(Path(src).resolve())
        problem = confinement_problem()
        if problem:
            raise GradingSandboxError(problem)
        try:
            grader = system_user.ensure(GRADER_USER)
        except system_user.SystemUserError as e:
            raise GradingSandboxError(str(e)) from None
        owner = (grader.pw_uid, grader.pw_gid)
        environment = self.environment(instance, repo_source)
        if self.root:
            self.root.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", iid)
        root = Path(tempfile.mkdtemp(prefix=f"ep-sandbox-{safe}-", dir=self.root))
        sb = ProcessSandbox(root, owner, environment, keep=self.keep)
        try:
            if environment is not None:
                try:
                    environment.checkout(root / "environment", owner)
                except GradingEnvironmentError as e:
                    raise GradingSandboxError(f"{iid}: {e}", reason="environment_unavailable") from e
            for args in (
                ["git", "clone", "-q", "--no-hardlinks", src, str(sb.testbed)],
                ["git", "-c", "advice.detachedHead=false", "checkout", "-q", base_commit],
            ):
                r = subprocess.run(
                    args, cwd=str(sb.testbed if args[1] != "clone" else root), env=sb.env,
                    stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=self.clone_timeout, check=False,
                )
                if r.returncode != 0:
                    raise GradingSandboxError(f"{' '.join(args[:3])} failed ({r.returncode}): {r.stderr.strip()}")
            system_user.give(sb.testbed, *owner)  # the grading's from here on
            if environment is not None and not installs_packages(instance["eval_script"]):
                # what an instance image's build did: the repository installed into testbed (an eval script
                # that reinstalls it would only repeat this)
                r = sb.exec(f"source {CONTAINER_CONDA_ROOT}/bin/activate && conda activate testbed && "
                            f"{environment.recipe.install}", timeout=self.clone_timeout)
                if r.exit_code != 0:
                    raise GradingSandboxError(f"{environment.recipe.install!r} failed in {environment.path} "
                                              f"({r.exit_code}): {r.output.strip()[-2000:]}",
                                              reason="environment_unavailable")
        except GradingSandboxError:
            sb.close()
            raise
        except (OSError, subprocess.SubprocessError) as e:
            sb.close()
            raise GradingSandboxError(f"could not prepare sandbox: {e}") from e
        return sb

    def grade(self, job: EvalJob, patch: str, logs_root: str | Path) -> Verdict:
        """Grade `patch` for `job` (non-empty; grading.grade checks) in a fresh sandbox.

        Idempotent: the instance's log directory is recreated, so grading the same (run, instance,
        attempt) again gives the same verdict and files.
        """
        started = utcnow()
        iid = job.ref.instance_id
        log_dir = instance_log_dir(logs_root, job.ref.run, job.ref.attempt, job.model_name, iid)
        if log_dir.exists():
            shutil.rmtree(log_dir)
        log_dir.mkdir(parents=True)
        logger = _instance_logger(log_dir / LOG_INSTANCE)
        pred = {"instance_id": iid, "model_name_or_path": job.model_name, "model_patch": patch}

        def verdict(outcome: EvalOutcome, report: dict | None = None, reason: str | None = None) -> Verdict:
            entry = (report or {}).get(iid, {})
            return Verdict(
                ref=job.ref,
                outcome=outcome,
                resolved=outcome is EvalOutcome.RESOLVED,
                report=entry,
                reason=reason,
                started_at=started,
                ended_at=utcnow(),
            )

        sandbox: Sandbox | None = None
        try:
            (log_dir / "patch.diff").write_text(patch)
            try:
                if job.instance.get("instance_id") != iid:
                    row_iid = job.instance.get("instance_id")
                    raise ValueError(f"instance row is for {row_iid!r}, job is for {iid!r}")
                test_spec = make_test_spec(job.instance)
                base_commit = job.instance["base_commit"]
            except (KeyError, ValueError, TypeError) as e:
                logger.error(f"Unusable instance row: {e!r}")
                return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry("bad_instance_row")},
                               reason=f"bad instance row: {e!r}")

            logger.info(f"Creating sandbox ({self.name}) for {iid}...")
            try:
                sandbox = self.create(instance=job.instance, repo_source=job.repo_source)
            except GradingSandboxError as e:
                logger.error(f"Error creating sandbox for {iid}: {e}")
                return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry(e.reason)}, reason=f"sandbox: {e}")
            logger.info(f"Sandbox for {iid} ready at base commit {base_commit}")

            logger.info(
                f"Intermediate patch for {iid} written to {log_dir / 'patch.diff'}, now applying to container..."
            )
            sandbox.put_file(CONTAINER_PATCH_FILE, patch)
            applied, apply_output = apply_patch(sandbox, logger)
            if not applied:
                logger.info(f"{APPLY_PATCH_FAIL}:\n{apply_output}")
                # official: EvaluationError, no report.json; the verdict still carries the official report
                # entry computed by get_eval_report from this log (which holds the marker).
                report = get_eval_report(test_spec, pred, str(log_dir / LOG_INSTANCE), include_tests_status=True)
                return verdict(EvalOutcome.APPLY_FAILED, report, reason=APPLY_PATCH_FAIL)

            diff_before = sandbox.exec("git -c core.fileMode=false diff").output.strip()
            logger.info(f"Git diff before:\n{diff_before}")

            eval_script = test_spec.eval_script
            (log_dir / "eval.sh").write_text(eval_script)
            logger.info(f"Eval script for {iid} written to {log_dir / 'eval.sh'}; copying to container...")
            sandbox.put_file("/eval.sh", eval_script)

            res = sandbox.exec("/bin/bash /eval.sh", timeout=job.timeout_s)
            test_output_path = log_dir / LOG_TEST_OUTPUT
            logger.info(f"Test runtime: {res.runtime_s:_.2f} seconds")
            with open(test_output_path, "w") as f:
                f.write(res.output)
                logger.info(f"Test output for {iid} written to {test_output_path}")
                if res.timed_out:
                    f.write(timeout_text(job.timeout_s))
            if res.timed_out:
                logger.info(f"Test timed out after {job.timeout_s} seconds; process group {res.pgid} killed.")
                return verdict(EvalOutcome.TIMEOUT, reason=f"tests timed out after {job.timeout_s} s")

            diff_after = sandbox.exec("git -c core.fileMode=false diff").output.strip()
            logger.info(f"Git diff after:\n{diff_after}")
            if diff_after != diff_before:
                logger.info("Git diff changed after running eval script")

            logger.info(f"Grading answer for {iid}...")
            report = get_eval_report(test_spec, pred, str(test_output_path), include_tests_status=True)
            entry = report[iid]
            logger.info(f"report: {report}\nResult for {iid}: resolved: {entry['resolved']}")
            (log_dir / LOG_REPORT).write_text(json.dumps(report, indent=4))
            if entry["resolved"]:
                return verdict(EvalOutcome.RESOLVED, report)
            if not entry["patch_successfully_applied"]:
                sandbox.close()  # releases the environment for the base run
                logger.info("No valid test output: running the eval script on the untouched base...")
                if not self.run_on_base(job.instance, job.repo_source, log_dir / BASE_TEST_OUTPUT, job.timeout_s):
                    logger.info(f"No valid test output on the base either: {ENVIRONMENT_BROKEN}")
                    entry = environment_broken(entry)
                    (log_dir / LOG_REPORT).write_text(json.dumps({iid: entry}, indent=4))
                    return verdict(EvalOutcome.INFRA_ERROR, {iid: entry}, reason=ENVIRONMENT_BROKEN_REASON)
                logger.info("The base gives valid test output: the patch broke the test run")
                reason = "no valid test output"
                if entry.get("infra_failure_reason"):
                    reason += f" ({entry['infra_failure_reason']})"
                return verdict(EvalOutcome.ERROR, report, reason=reason)
            return verdict(EvalOutcome.UNRESOLVED, report)
        except GradingSandboxError as e:
            logger.error(f"Sandbox error for {iid}: {e}\n{traceback.format_exc()}")
            return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry(e.reason)}, reason=f"sandbox: {e}")
        except OSError as e:
            logger.error(f"I/O error for {iid}: {e}\n{traceback.format_exc()}")
            return verdict(EvalOutcome.INFRA_ERROR, {iid: infra_entry("io_error")}, reason=f"io: {e}")
        finally:
            if sandbox is not None:
                sandbox.close()
            _close_logger(logger)

    def run_on_base(self, instance: dict, repo_source: str, out_path: Path, timeout_s: float) -> bool:
        """The eval script on the untouched base commit, in a fresh sandbox of the same environment; its output
        (merged, with the official timeout line) goes to out_path. True iff it gave valid test output."""
        test_spec = make_test_spec(instance)
        sandbox = self.create(instance=instance, repo_source=repo_source)
        try:
            sandbox.put_file("/eval.sh", test_spec.eval_script)
            res = sandbox.exec("/bin/bash /eval.sh", timeout=timeout_s)
        finally:
            sandbox.close()
        out_path.write_text(res.output + (timeout_text(timeout_s) if res.timed_out else ""))
        return not res.timed_out and get_logs_eval(test_spec, str(out_path))[1]

    # ------------------------------------------------------------------ gold validation

    def validation_subject(self, row: dict, repo_source: str) -> ValidationSubject:
        """What the process grader grades on: the repository source, the base commit and the environment (its
        recipe, interpreter and layout; without a recipe, the worker's Python and pytest)."""
        import importlib.metadata

        if not repo_source:
            raise ValueError("the process backend needs repos_dir")
        h = hashlib.sha256()
        src = Path(repo_source)
        h.update(src.read_bytes() if src.is_file() else repo_source.encode())
        env = self.environment(row, repo_source)
        where = env.path.name if env else f"{sys.version}|pytest {importlib.metadata.version('pytest')}"
        h.update(f"{row['base_commit']}|{where}".encode())
        return ValidationSubject(f"process:sha256:{h.hexdigest()}", row)

    def base_report(self, row: dict, repo_source: str, run: str, logs_root: Path, timeout_s: float) -> dict | None:
        """The eval script on an untouched checkout, graded with the official get_eval_report."""
        iid = row["instance_id"]
        ts = make_test_spec(row)
        log_dir = instance_log_dir(logs_root, run, 1, EMPTY_MODEL, iid)
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "eval.sh").write_text(ts.eval_script)
        out = log_dir / LOG_TEST_OUTPUT
        self.run_on_base(row, repo_source, out, timeout_s)
        if out.read_text(errors="replace").endswith(timeout_text(timeout_s)):
            return None
        pred = {"instance_id": iid, "model_name_or_path": EMPTY_MODEL, "model_patch": ""}
        return get_eval_report(ts, pred, str(out), include_tests_status=True)[iid]


__all__ = ["ProcessGrader", "apply_patch"]
