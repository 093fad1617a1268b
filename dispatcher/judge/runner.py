"""The judge's pass over a run: every attempt without a verdict for the rubric gets one row in judge_verdicts.

Idempotent and resumable: the verdict's key is (attempt, rubric) and a pass only takes attempts without one. Each
answer is stored in S3 as soon as it arrives (runs/<run>/judge/<rubric sha>/<instance>/<attempt>.json, with the
call's ledger rows once the shim has stopped), so a pass killed between the answer and its row lands that answer
on restart instead of asking again. The judge's calls land in the ledger (calls) under its own run name,
<run>.judge, in the same transaction as the verdict.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Literal

import psycopg
from psycopg.types.json import Jsonb
from pydantic import BaseModel, Field

from contract import aws
from contract.models import AttemptLimits, AttemptRef, CallRecord
from dispatcher.judge import prompt
from dispatcher.judge.rubric import Rubric
from dispatcher.judge.shim import JudgeShim, answer_text, ledger_rows

log = logging.getLogger("evalplane.judge")

_CALL_COLUMNS = tuple(CallRecord.model_fields)
_INSERT_CALL = (f"INSERT INTO calls ({', '.join(_CALL_COLUMNS)}) VALUES ({', '.join(['%s'] * len(_CALL_COLUMNS))})"
                " ON CONFLICT (call_id) DO NOTHING")  # a few rows per verdict: no need for the writer's COPY
_INSERT_VERDICT = """INSERT INTO judge_verdicts (run, instance_id, attempt, rubric_sha, rubric, status, answers, problem,
                        raw_answer, judge_run, model, calls, cost_usd)
                     VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"""


class JudgeSettings(BaseModel):
    provider: Literal["openai", "anthropic"] = "openai"
    model: str = Field("gpt-4o-mini", min_length=1)
    upstream_url: str
    upstream_model: str | None = None  # the judge's alias at the gateway (with --gateway): what its shims send
    budget_usd: float = Field(gt=0)  # the judge's own run cap, across all its calls
    attempt_usd: float | None = Field(None, gt=0)  # per trajectory
    max_tokens: int = Field(1024, ge=1)
    concurrency: int = Field(2, ge=1, le=64)
    valkey_url: str | None = None  # the judge's budget across its shims (without it each shim caps only itself)


@dataclass
class Pending:
    ref: AttemptRef
    trajectory_uri: str | None
    patch_uri: str | None


@dataclass
class PassSummary:
    judged: int = 0
    parse_failures: int = 0
    no_trajectory: int = 0
    over_attempt_cap: int = 0
    left: int = 0  # no verdict yet: the budget ran out, or the model could not be reached (rerun to finish)
    problems: list[str] = field(default_factory=list)
    budget_exhausted: bool = False


def judge_run_name(run: str) -> str:
    """The ledger's run name for the judge's calls ('.' never appears in a run's own name)."""
    return f"{run}.judge"


class JudgePass:
    def __init__(self, run: str, rubric: Rubric, settings: JudgeSettings, key: str, work_dir: Path,
                 database_url: str):
        self.run, self.rubric, self.settings, self.key = run, rubric, settings, key
        self.work_dir, self.database_url = work_dir, database_url
        self.judge_run = judge_run_name(run)
        self.pool = f"{settings.model}@judge"
        self._stop = threading.Event()  # the judge's budget is spent: no new calls
        self._local = threading.local()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the pass

    def pending(self, conn: psycopg.Connection) -> list[Pending]:
        rows = conn.execute(
            """SELECT a.instance_id, a.attempt, a.trajectory_uri, a.patch_uri FROM attempts a
               WHERE a.run = %s AND NOT EXISTS (SELECT 1 FROM judge_verdicts v WHERE v.run = a.run
                 AND v.instance_id = a.instance_id AND v.attempt = a.attempt AND v.rubric_sha = %s)
               ORDER BY a.instance_id, a.attempt""", (self.run, self.rubric.sha)).fetchall()
        conn.commit()
        return [Pending(AttemptRef(run=self.run, instance_id=i, attempt=n), t, p) for i, n, t, p in rows]

    def run_pass(self) -> PassSummary:
        with psycopg.connect(self.database_url) as conn:
            todo = self.pending(conn)
        summary = PassSummary()
        with ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix="judge") as pool:
            try:
                for outcome in pool.map(self._judge_safely, todo):
                    self._count(summary, outcome)
            except BaseException:  # interrupted: the queued attempts return at once (the executor's exit would
                self._stop.set()   # otherwise judge them all); the calls in flight finish and land
                raise
        summary.budget_exhausted = self._stop.is_set()
        return summary

    def _count(self, s: PassSummary, outcome: tuple[str, str | None]) -> None:
        status, problem = outcome
        if status == "judged":
            s.judged += 1
        elif status == "parse_failure":
            s.parse_failures += 1
        elif status == "no_trajectory":
            s.no_trajectory += 1
        elif status == "over_attempt_cap":
            s.over_attempt_cap += 1
        else:
            s.left += 1
            if problem:
                s.problems.append(problem)

    def _judge_safely(self, p: Pending) -> tuple[str, str | None]:
        try:
            return self.judge_one(p)
        except Exception as e:  # one attempt's failure (S3, the shim) leaves it for a rerun
            log.exception("judging %s failed", p.ref.slug)
            return "left", f"{p.ref.slug}: {type(e).__name__}: {e}"

    # ------------------------------------------------------------ one attempt

    def answer_uri(self, p: Pending) -> str | None:
        """Where this attempt's answer is kept: beside the run's artifacts (the bucket of its trajectory)."""
        if not p.trajectory_uri:
            return None
        bucket, _ = aws.split_s3_uri(p.trajectory_uri)
        return f"s3://{bucket}/runs/{self.run}/judge/{self.rubric.sha}/{p.ref.instance_id}/{p.ref.attempt}.json"

    def workdir(self, p: Pending) -> Path:
        return self.work_dir / self.judge_run / self.rubric.sha / p.ref.instance_id / str(p.ref.attempt)

    def judge_one(self, p: Pending) -> tuple[str, str | None]:
        """Returns (verdict status, or 'left' with why no verdict was written)."""
        if not p.trajectory_uri:
            self._land(p, [], "no_trajectory", problem="the attempt has no trajectory")
            return "no_trajectory", None
        uri = self.answer_uri(p)
        stored = _get_json(uri)
        workdir = self.workdir(p)
        if stored is None:
            if self._stop.is_set():
                return "left", None
            try:
                trajectory = json.loads(aws.get_text(p.trajectory_uri))
            except ValueError as e:
                self._land(p, [], "no_trajectory", problem=f"the trajectory is not JSON: {e}")
                return "no_trajectory", None
            patch = aws.get_text(p.patch_uri) if p.patch_uri else ""
            messages = prompt.messages(self.rubric, trajectory, patch, self._problem(p))
            shim = JudgeShim(workdir, ref=AttemptRef(run=self.judge_run, instance_id=p.ref.instance_id,
                                                     attempt=p.ref.attempt),
                             upstream_url=self.settings.upstream_url, provider=self.settings.provider,
                             model=self.settings.model, upstream_model=self.settings.upstream_model,
                             pool=self.pool, key=self.key,
                             valkey_url=self.settings.valkey_url,
                             limits=AttemptLimits(cost_usd=self.settings.attempt_usd),
                             run_cost_usd=self.settings.budget_usd)
            try:
                status, body = shim.ask(messages, self.settings.max_tokens)
                stored = {"status": status, "body": body, "rows": None}
                aws.put_text(uri, json.dumps(stored))  # the answer is safe before anything else happens
            finally:
                shim.stop()
            stored["rows"] = [r.model_dump(mode="json") for r in ledger_rows(shim.ledger)]
            aws.put_text(uri, json.dumps(stored))
        rows = [CallRecord.model_validate(r) for r in stored["rows"]] if stored.get("rows") is not None \
            else ledger_rows(workdir / "ledger.jsonl")  # killed before the rows were stored: the shim's file
        return self._settle(p, stored, rows, uri)

    def _settle(self, p: Pending, stored: dict, rows: list[CallRecord], uri: str) -> tuple[str, str | None]:
        status, body = stored["status"], stored["body"]
        if status == 200:
            text = answer_text(self.settings.provider, body)
            if text is None:
                self._land(p, rows, "parse_failure", problem="the response has no text", raw=json.dumps(body))
                return "parse_failure", None
            try:
                answers = prompt.parse(text, self.rubric)
            except prompt.ParseFailure as e:
                self._land(p, rows, "parse_failure", problem=str(e), raw=text)
                return "parse_failure", None
            self._land(p, rows, "judged", answers=answers, raw=text)
            return "judged", None
        message = json.dumps(body)[:500]
        self._land(p, rows, None)  # the calls are spent either way: into the ledger
        bucket, key = aws.split_s3_uri(uri)
        aws.client("s3").delete_object(Bucket=bucket, Key=key)  # no verdict: a later pass asks again
        if status == 403 and "budget_exceeded" in message and "attempt cost cap" in message:
            self._land(p, [], "over_attempt_cap", problem=f"the trajectory's call exceeds the per-trajectory cap "
                                                          f"(${self.settings.attempt_usd}): {message}")
            return "over_attempt_cap", None
        if status == 403 and "budget_exceeded" in message:
            self._stop.set()
            return "left", f"{p.ref.slug}: the judge's budget (${self.settings.budget_usd}) is spent"
        return "left", f"{p.ref.slug}: the model could not be asked (HTTP {status}: {message})"

    def _problem(self, p: Pending) -> str | None:
        """The problem statement, from the attempt's job document (None if it is gone: the transcript has it)."""
        bucket, _ = aws.split_s3_uri(p.trajectory_uri)
        job = _get_json(f"s3://{bucket}/runs/{self.run}/jobs/{p.ref.instance_id}/{p.ref.attempt}.json")
        return (job or {}).get("instance", {}).get("problem_statement")

    # ------------------------------------------------------------ rows

    def _conn(self) -> psycopg.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = self._local.conn = psycopg.connect(self.database_url)
        return conn

    def _land(self, p: Pending, rows: list[CallRecord], status: str | None, *, answers: dict | None = None,
              problem: str | None = None, raw: str | None = None) -> None:
        """The judge's ledger rows and (unless `status` is None) the verdict, in one transaction."""
        conn = self._conn()
        with conn.transaction():
            for r in rows:
                values = r.model_dump()
                values["raw_usage"] = Jsonb(values["raw_usage"]) if values["raw_usage"] is not None else None
                conn.execute(_INSERT_CALL, [values[c] for c in _CALL_COLUMNS])
            if status is not None:
                cost = sum((Decimal(str(r.cost_usd)) for r in rows), start=Decimal(0))
                conn.execute(_INSERT_VERDICT, (
                    self.run, p.ref.instance_id, p.ref.attempt, self.rubric.sha, self.rubric.name, status,
                    Jsonb(answers) if answers is not None else None, problem, raw, self.judge_run,
                    self.settings.model, len(rows), cost))


def _get_json(uri: str | None) -> dict | None:
    if uri is None:
        return None
    try:
        return json.loads(aws.get_text(uri))
    except Exception:  # noqa: BLE001 - absent (or unreadable): as if never stored
        return None
