"""`regrade`: grade a finished run's recorded patches again, without touching a verdict already given.

  from logs     the test output each grading recorded (its eval logs in S3) parsed again with the installed
                swebench's parser and get_eval_report: no container, no test run (as `swebench report RUN_ID`)
  on images     each patch graded again by the docker grader in the image named for its instance (by digest)

Every new verdict is a `gradings` row beside the attempt's first (the attempts row) and any earlier regrade, with
the grader's version, the image it graded on and when; the results, the report and the official outputs read an
attempt's latest (the attempt_verdicts view). `changes` lists what a regrade changed.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

from contract import aws
from contract.models import AttemptRef, EvalJob, EvalOutcome
from dispatcher.driver.writer import verdict_status
from dispatcher.plan import Plan

# attempts a regrade takes: those whose grading recorded a verdict of the patch (not an empty patch, not a
# grading whose environment failed: that has no test output of the patch to read again)
GRADED = ("RESOLVED", "UNRESOLVED", "EVAL_ERROR")


@dataclass(frozen=True)
class Regraded:
    ref: AttemptRef
    before: str  # the status of the verdict it had
    after: str | None  # None: not regraded (why says why)
    why: str = ""


def graded_attempts(conn: psycopg.Connection, run: str) -> list[dict]:
    """The run's graded attempts with their latest verdict and their patch."""
    cur = conn.execute(
        """SELECT a.instance_id, a.attempt, a.model, a.patch_uri, v.status, v.report FROM attempts a
           JOIN attempt_verdicts v USING (run, instance_id, attempt)
           WHERE a.run = %s AND v.status = ANY(%s) AND a.patch_uri IS NOT NULL ORDER BY a.instance_id, a.attempt""",
        (run, list(GRADED)))
    cols = [d.name for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    conn.commit()
    return rows


def record(conn: psycopg.Connection, ref: AttemptRef, how: str, grader_version: str, image_digest: str | None,
           outcome: EvalOutcome, resolved: bool, report: dict) -> None:
    conn.execute(
        """INSERT INTO gradings (run, instance_id, attempt, how, grader_version, image_digest, status, eval_outcome,
                                 resolved, report) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
        (ref.run, ref.instance_id, ref.attempt, how, grader_version, image_digest, verdict_status(outcome).value,
         outcome.value, resolved, Jsonb(report)))


def swebench_version() -> str:
    import swebench

    return f"swebench {swebench.__version__}"


def outcome_of(entry: dict) -> EvalOutcome:
    """The outcome an official report entry is (as eval_worker.docker_backend.classify reads run_instance's)."""
    if entry["resolved"]:
        return EvalOutcome.RESOLVED
    if not entry["patch_successfully_applied"]:
        return EvalOutcome.ERROR
    return EvalOutcome.UNRESOLVED


def from_logs(conn: psycopg.Connection, plan: Plan, artifacts_prefix: Callable[[AttemptRef], str]) -> list[Regraded]:
    """Each graded attempt's recorded test output parsed again by the installed swebench (its instance's
    log_parser, get_eval_report): a new verdict each, recorded beside the old."""
    from swebench.harness.constants import LOG_TEST_OUTPUT
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    run = plan.spec.run.name
    done = []
    with tempfile.TemporaryDirectory(prefix="regrade-") as tmp:
        for a in graded_attempts(conn, run):
            ref = AttemptRef(run=run, instance_id=a["instance_id"], attempt=a["attempt"])
            row = plan.rows.get(ref.instance_id)
            log = aws.get_text_if_exists(aws.eval_logs_prefix(artifacts_prefix(ref)) + LOG_TEST_OUTPUT)
            if row is None or log is None:
                done.append(Regraded(ref, a["status"], None, "no instance row" if row is None else "no test output"))
                continue
            path = Path(tmp) / f"{ref.instance_id}.{ref.attempt}.txt"
            path.write_text(log)
            spec = make_test_spec(row)
            pred = {"instance_id": ref.instance_id, "model_name_or_path": a["model"],
                    "model_patch": aws.get_text(a["patch_uri"])}
            entry = get_eval_report(spec, pred, str(path), include_tests_status=True)[ref.instance_id]
            outcome = outcome_of(entry)
            record(conn, ref, "logs", f"{swebench_version()} {spec.log_parser}", None, outcome, entry["resolved"],
                   entry)
            conn.commit()
            done.append(Regraded(ref, a["status"], verdict_status(outcome).value))
    return done


def on_images(conn: psycopg.Connection, plan: Plan, images: dict[str, str], artifacts_prefix, grader,
              logs_root: Path, timeout_s: float) -> list[Regraded]:
    """Each graded attempt of an instance named in `images` graded again by `grader` (the docker grader) in that
    image: a new verdict each, recorded with the image it graded on."""
    run = plan.spec.run.name
    done = []
    for a in graded_attempts(conn, run):
        ref = AttemptRef(run=run, instance_id=a["instance_id"], attempt=a["attempt"])
        image = images.get(ref.instance_id)
        if image is None:
            continue
        job = EvalJob(ref=ref, model_name=a["model"], patch_uri=a["patch_uri"],
                      instance=plan.rows[ref.instance_id] | {"image": image},
                      repo_source=plan.repo_sources[ref.instance_id], verdict_queue_url="",
                      artifacts_prefix=artifacts_prefix(ref), timeout_s=timeout_s)
        v = grader.grade(job, aws.get_text(a["patch_uri"]), logs_root)
        record(conn, ref, "images", f"{swebench_version()} {grader.name}", image, v.outcome, v.resolved,
               v.report.get(ref.instance_id, v.report))
        conn.commit()
        done.append(Regraded(ref, a["status"], verdict_status(v.outcome).value))
    return done


def changes(conn: psycopg.Connection, run: str) -> list[dict]:
    """Every attempt whose verdict a regrade changed: its first status, its latest, and how the latest was given."""
    cur = conn.execute(
        """SELECT a.instance_id, a.attempt, a.status AS first, v.status AS latest, g.how, g.grader_version,
                  g.image_digest, g.graded_at
           FROM attempts a JOIN attempt_verdicts v USING (run, instance_id, attempt)
           JOIN gradings g ON g.id = v.grading_id
           WHERE a.run = %s AND (a.status <> v.status OR a.report IS DISTINCT FROM v.report)
           ORDER BY a.instance_id, a.attempt""", (run,))
    cols = [d.name for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    conn.commit()
    return rows
