"""The results writer: consume the run's results queue, land rows idempotently, then delete the messages.

Messages are decoded once (orjson): attempt results and verdicts into their pydantic models; ledger rows stay JSON
values that COPY hands to PostgreSQL, which types them against the calls table (ledger rows are ten or more per
attempt: typing them in Python first, then again in the database, was most of the writer's cost). A batch the
database refuses is landed message by message, and a message it refuses on its own is left on the queue for its
dead-letter queue.

Order per batch: land every message's rows in one transaction and commit; enqueue eval jobs for
attempts that just became PATCH_READY and mark them enqueued; only then delete the messages. A crash
anywhere re-delivers the batch and the unique keys absorb the repeats; `sweep()` re-enqueues eval
jobs that were committed but never sent.

A batch is what the queue holds, up to BATCH_MESSAGES: each transaction and each round trip is paid once per batch,
not per ten messages, once the writers are behind (when their rate matters). A transaction is BEGIN, one COPY of
every ledger row, one statement for every attempt row, COMMIT (and a verdict's update); a ledger row already
landed (a redelivered message) fails the COPY, and the batch is landed again through the staging table.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
from psycopg.types.json import Json, Jsonb, set_json_dumps
from pydantic_core import PydanticUndefined

from contract import aws
from contract.models import (
    AttemptRef,
    AttemptResult,
    AttemptStatus,
    CallRecord,
    Envelope,
    EvalJob,
    EvalOutcome,
    HarnessOutcome,
    Job,
    LedgerBatch,
    Verdict,
    utcnow,
)
from contract.signing import RunKeys
from dispatcher.backends.resources import RunResources
from dispatcher.driver.message_auth import RECEIVE_ATTRIBUTES, MessageAuth, signature_of

log = logging.getLogger("evalplane.writer")

_CALL_COLUMNS = tuple(CallRecord.model_fields)  # the calls table's columns, in the model's words
# Fields a producer may leave out take the model's defaults (see _copy_values).
_CALL_DEFAULTS = {name: f.default for name, f in CallRecord.model_fields.items()
                  if f.default is not PydanticUndefined and f.default_factory is None}
_COPY_CALLS = f"COPY calls ({', '.join(_CALL_COLUMNS)}) FROM STDIN"
_COPY_STAGE = f"COPY calls_stage ({', '.join(_CALL_COLUMNS)}) FROM STDIN"
_row_values = operator.itemgetter(*_CALL_COLUMNS)
# positions of the JSON-object columns (raw_usage), which COPY needs wrapped as jsonb
_JSON_AT = tuple(i for i, f in enumerate(CallRecord.model_fields.values()) if "dict" in str(f.annotation))


def _copy_values(row: dict[str, Any]) -> list[Any]:
    """A ledger row as COPY values: text stays text (PostgreSQL types it), objects become jsonb; a field the
    producer left out takes the model's default (one without a default is NULL, which the table refuses)."""
    try:
        values = list(_row_values(row))
    except KeyError:
        values = [row.get(c, _CALL_DEFAULTS.get(c)) for c in _CALL_COLUMNS]
    for i in _JSON_AT:
        if values[i] is not None:
            values[i] = Jsonb(values[i])
    return values


class Undeliverable(ValueError):
    """A results message that cannot be read (left on the queue for its dead-letter queue)."""


@dataclass(slots=True)
class Incoming:
    """One results message, decoded: its typed part, and its ledger rows still as JSON values."""

    msg: LedgerBatch | AttemptResult | Verdict  # a LedgerBatch's and an AttemptResult's rows are moved to `rows`
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.msg.kind

    @classmethod
    def decode(cls, body: str | bytes) -> Incoming:
        try:
            doc = orjson.loads(body)
            msg = doc["msg"]
            rows_key = {"ledger": "rows", "attempt_result": "ledger"}.get(msg.get("kind"))
            rows = msg.pop(rows_key, []) if rows_key else []
            if rows_key == "rows":
                msg["rows"] = []
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise ValueError(f"msg.{rows_key}: expected a list of objects")
            return cls(Envelope.model_validate(doc).msg, rows)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise Undeliverable(f"unreadable results message: {e}") from e

    @classmethod
    def of(cls, env: Envelope) -> Incoming:
        """From a typed envelope (tests, and anything built in Python)."""
        m = env.msg
        if isinstance(m, LedgerBatch):
            return cls(m.model_copy(update={"rows": []}), [r.model_dump(mode="json") for r in m.rows])
        if isinstance(m, AttemptResult):
            return cls(m.model_copy(update={"ledger": []}), [r.model_dump(mode="json") for r in m.ledger])
        return cls(m)


_ATTEMPT_COLUMNS = (
    "run", "instance_id", "attempt", "harness", "pool", "model", "outcome", "status", "patch_uri", "patch_bytes",
    "trajectory_uri", "calls", "input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens", "cost_usd",
    "wall_time_s", "started_at", "ended_at", "error", "task_cpu", "task_memory_mib", "task_memory_limit_mib",
    "task_cpu_s", "task_memory_peak_bytes", "task_wall_s", "usage_source",
)


_ATTEMPT_TYPES = ("text", "text", "int", "text", "text", "text", "text", "text", "text", "int", "text", "int", "bigint",
                  "bigint", "bigint", "bigint", "numeric", "float8", "timestamptz", "timestamptz", "text", "float8", "int",
                  "int", "float8", "bigint", "float8", "text")
# One statement per batch, one JSON parameter: the attempt rows (DISTINCT ON drops a repeat inside the batch), and
# a harness phase row for each attempt row that is new (RETURNING tells: a redelivery returns nothing).
_INSERT_ATTEMPTS = f"""
WITH src AS (
    SELECT * FROM json_to_recordset(%s::json) AS t({", ".join(f"{c} {t}" for c, t in zip(_ATTEMPT_COLUMNS,
                                                                                         _ATTEMPT_TYPES))}, detail jsonb)
), new AS (
    INSERT INTO attempts ({", ".join(_ATTEMPT_COLUMNS)})
    SELECT DISTINCT ON (run, instance_id, attempt) {", ".join(_ATTEMPT_COLUMNS)} FROM src
    ON CONFLICT (run, instance_id, attempt) DO NOTHING
    RETURNING run, instance_id, attempt, status
), phase AS (
    INSERT INTO phases (run, instance_id, attempt, phase, started_at, ended_at, outcome, detail)
    SELECT DISTINCT ON (run, instance_id, attempt) run, instance_id, attempt, 'harness', started_at, ended_at,
           outcome, detail
    FROM src JOIN new USING (run, instance_id, attempt)
    ON CONFLICT DO NOTHING
)
SELECT run, instance_id, attempt, status FROM new
"""


def verdict_status(outcome: EvalOutcome) -> AttemptStatus:
    """The attempt status a grading outcome lands as (apply failures, timeouts and errors are EVAL_ERROR)."""
    return _VERDICT_STATUS.get(outcome, AttemptStatus.EVAL_ERROR)


VERDICT_LOST = "verdict_lost"  # the infra_failure_reason of an attempt whose verdict never came

_VERDICT_STATUS = {
    EvalOutcome.RESOLVED: AttemptStatus.RESOLVED,
    EvalOutcome.UNRESOLVED: AttemptStatus.UNRESOLVED,
    EvalOutcome.INFRA_ERROR: AttemptStatus.INFRA_ERROR,
}


class ResultsWriter:
    BATCH_MESSAGES = 400  # the most messages a poll lands in one transaction

    def __init__(self, res: RunResources, database_url: str, eval_timeout_s: float = 1800.0, *, keys: RunKeys):
        self.res = res
        self.auth = MessageAuth(res, keys)  # what may land (dispatcher/driver/message_auth.py)
        self.database_url = database_url
        self.eval_timeout_s = eval_timeout_s
        self.landed = {"ledger": 0, "attempt_result": 0, "verdict": 0}
        self.busy_s = {"receive": 0.0, "decode": 0.0, "land": 0.0, "enqueue eval": 0.0, "delete": 0.0}
        self.batches = 0  # polls that landed something (landed messages / batches: how full the batches ran)
        self.redelivered_batches = 0  # batches landed again through the staging table (a ledger row was in)
        self._conn: psycopg.Connection | None = None

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.database_url)
            set_json_dumps(orjson.dumps, context=self._conn)
            with self._conn.transaction():  # the staging table for redelivered ledger rows, once per session
                self._conn.execute("CREATE TEMP TABLE calls_stage (LIKE calls INCLUDING DEFAULTS) ON COMMIT DELETE ROWS")
        return self._conn

    # ------------------------------------------------------------ landing

    def land(self, messages: list[Incoming | Envelope]) -> list[AttemptRef]:
        """Land a batch in one transaction; return the attempts that became PATCH_READY."""
        batch = [m if isinstance(m, Incoming) else Incoming.of(m) for m in messages]
        rows = [r for m in batch for r in m.rows]
        try:
            ready = self._land(batch, rows, redelivered=False)
        except psycopg.errors.UniqueViolation:  # a ledger row is in already: the same batch, absorbing repeats
            self.redelivered_batches += 1
            ready = self._land(batch, rows, redelivered=True)
        for m in batch:
            self.landed[m.kind] += 1
        return ready

    def _land(self, batch: list[Incoming], rows: list[dict[str, Any]], redelivered: bool) -> list[AttemptRef]:
        ready: list[AttemptRef] = []
        with self.conn.transaction(), self.conn.cursor() as cur:
            if rows:
                self._copy_calls(cur, rows, redelivered)
            results = [m.msg for m in batch if isinstance(m.msg, AttemptResult)]
            if results:
                ready = self._land_attempts(cur, results)
            for m in batch:
                if isinstance(m.msg, Verdict):
                    self._land_verdict(cur, m.msg)
        return ready

    @staticmethod
    def _copy_calls(cur, rows: list[dict[str, Any]], redelivered: bool) -> None:
        """COPY straight into the ledger (a row already there fails it, and the transaction with it); for a batch
        known to repeat rows, COPY into a staging table and INSERT .. ON CONFLICT DO NOTHING from it, so the
        call_id key absorbs the repeats."""
        with cur.copy(_COPY_STAGE if redelivered else _COPY_CALLS) as copy:
            for r in rows:
                copy.write_row(_copy_values(r))
        if redelivered:
            cur.execute("INSERT INTO calls SELECT * FROM calls_stage ON CONFLICT (call_id) DO NOTHING")

    def land_each(self, batch: list[Incoming]) -> tuple[list[AttemptRef], set[int]]:
        """Land a refused batch one message at a time; returns what became PATCH_READY and the indexes of the
        messages the database refused on their own (left for the dead-letter queue). An attempt's row must land
        whatever its ledger rows hold: a refused result is landed without them, and they go back to the queue
        as a batch of their own (to the dead-letter queue if they are refused again)."""
        ready: list[AttemptRef] = []
        refused: set[int] = set()
        for i, m in enumerate(batch):
            try:
                ready += self.land([m])
            except (psycopg.DataError, psycopg.IntegrityError) as e:  # bad values, missing ones: this message
                if isinstance(m.msg, AttemptResult) and m.rows:
                    log.error("ledger rows of %s refused by the database (%s); its result lands without them,"
                              " they go back to the queue on their own", m.msg.ref.slug, e)
                    aws.send(self.res.results_queue_url, orjson.dumps(
                        {"msg": {"kind": "ledger", "ref": m.msg.ref.model_dump(), "rows": m.rows}}).decode(),
                        sign=self.auth.keys.attempt_signer(m.msg.ref))
                    ready += self.land([Incoming(m.msg)])
                    continue
                log.error("results message refused by the database, left for the dead-letter queue: %s", e)
                refused.add(i)
        return ready, refused

    @staticmethod
    def _land_attempts(cur, results: list[AttemptResult]) -> list[AttemptRef]:
        """The batch's attempt rows and, for those that are new, their harness phase rows (one statement).
        Returns the attempts that became PATCH_READY."""
        rows = []
        for r in results:
            if r.outcome is HarnessOutcome.CANCELLED:
                status = AttemptStatus.CANCELLED  # never graded
            elif r.outcome is HarnessOutcome.INFRA_ERROR:
                status = AttemptStatus.INFRA_ERROR  # never graded, never an empty patch: not the model's doing
            else:
                status = AttemptStatus.PATCH_READY if r.patch_bytes > 0 else AttemptStatus.EMPTY_PATCH
            t, res, use = r.totals, r.resources, r.usage
            rows.append({
                "run": r.ref.run, "instance_id": r.ref.instance_id, "attempt": r.ref.attempt, "harness": r.harness,
                "pool": r.pool, "model": r.model, "outcome": r.outcome.value, "status": status.value,
                "patch_uri": r.patch_uri, "patch_bytes": r.patch_bytes, "trajectory_uri": r.trajectory_uri,
                "calls": t.calls, "input_tokens": t.input_tokens, "cached_tokens": t.cached_tokens,
                "cache_write_tokens": t.cache_write_tokens, "output_tokens": t.output_tokens, "cost_usd": t.cost_usd,
                "wall_time_s": (r.ended_at - r.started_at).total_seconds(), "started_at": r.started_at.isoformat(),
                "ended_at": r.ended_at.isoformat(), "error": r.error,
                "task_cpu": res and res.cpu, "task_memory_mib": res and res.memory_mib,
                "task_memory_limit_mib": res and res.memory_limit_mib, "task_cpu_s": use and use.cpu_s,
                "task_memory_peak_bytes": use and use.memory_peak_bytes, "task_wall_s": use and use.wall_s,
                "usage_source": use and use.source,
                "detail": {"ledger_calls": r.ledger_calls, "error": r.error},
            })
        cur.execute(_INSERT_ATTEMPTS, (Json(rows),))
        return [AttemptRef(run=r, instance_id=i, attempt=a) for r, i, a, st in cur.fetchall()
                if st == AttemptStatus.PATCH_READY.value]

    def land_verdicts_lost(self, refs: list[AttemptRef], why: str) -> list[AttemptRef]:
        """Attempts whose verdict will never come (its grader died, or its message was lost): infra_error with the
        report entry of an infrastructure failure (reason verdict_lost), never the model's. A verdict that landed
        first stays, and one that comes later changes nothing (only a PATCH_READY row takes a verdict). Returns
        the attempts this landed."""
        from eval_worker.grading import infra_entry

        now = utcnow()
        landed = []
        with self.conn.transaction(), self.conn.cursor() as cur:
            for ref in refs:
                v = Verdict(ref=ref, outcome=EvalOutcome.INFRA_ERROR, resolved=False, report=infra_entry(VERDICT_LOST),
                            reason=f"{VERDICT_LOST}: {why}", started_at=now, ended_at=now)
                if self._land_verdict(cur, v):
                    landed.append(ref)
        return landed

    def _land_verdict(self, cur, v: Verdict) -> bool:
        status = verdict_status(v.outcome)
        cur.execute(
            """UPDATE attempts SET status = %s, eval_outcome = %s, resolved = %s, report = %s, tamper_flags = %s,
                      grading_wall_s = %s, grading_cpu_s = %s
               WHERE run = %s AND instance_id = %s AND attempt = %s AND status = 'PATCH_READY'""",
            (status.value, v.outcome.value, v.resolved, Jsonb(v.report),
             Jsonb([f.model_dump() for f in v.tamper_flags]), (v.ended_at - v.started_at).total_seconds(),
             v.grading_cpu_s, v.ref.run, v.ref.instance_id, v.ref.attempt),
        )
        if not cur.rowcount:
            return False
        cur.execute(
            "INSERT INTO phases (run, instance_id, attempt, phase, started_at, ended_at, outcome, detail)"
            " VALUES (%s,%s,%s,'eval',%s,%s,%s,%s) ON CONFLICT DO NOTHING",
            (v.ref.run, v.ref.instance_id, v.ref.attempt, v.started_at, v.ended_at, v.outcome.value,
             Jsonb({"reason": v.reason, "report_uri": v.report_uri})),
        )
        return True

    def ledger_copy(self, ref: AttemptRef) -> list[dict[str, Any]]:
        """The rows of the task's S3 ledger copy ([] if it left none, or an unreadable one, or one its attempt's key
        did not sign, or one naming another attempt)."""
        got = aws.get_signed_if_exists(aws.ledger_copy_uri(self.res.artifacts_prefix(ref)))
        if got is None:
            return []
        text, signature = got
        try:
            rows = [orjson.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            log.error("the S3 ledger copy of %s is unreadable, not recovered: %s", ref.slug, e)
            return []
        if why := self.auth.attempt_refusal(text, signature, Incoming(LedgerBatch(ref=ref, rows=[]), rows)):
            log.error("the S3 ledger copy of %s is refused, not recovered: %s", ref.slug, why)
            return []
        return rows

    def recover_ledgers(self, refs: list[AttemptRef]) -> int:
        """Attempts landed as infra_error without ledger rows (their task died before sending them): land whatever
        ledger rows the task's copy in S3 holds (a task that died after uploading it, before its result went
        out). The call_id key absorbs rows that arrived in batches already."""
        n = 0
        for ref in refs:
            rows = self.ledger_copy(ref)
            if not rows:
                continue
            try:
                with self.conn.transaction(), self.conn.cursor() as cur:
                    self._copy_calls(cur, rows, redelivered=True)  # some came in batches already
            except (psycopg.DataError, psycopg.IntegrityError) as e:
                log.error("the S3 ledger copy of %s was refused, not recovered: %s", ref.slug, e)
                continue
            n += len(rows)
            log.info("recovered %d ledger rows of %s from its S3 copy", len(rows), ref.slug)
        return n

    def land_unreported(self, ref: AttemptRef,
                        lost: Callable[[list[dict[str, Any]]], AttemptResult] | None) -> str | None:
        """Land an attempt whose result message never arrived (its task is gone), with every row of the task's S3
        ledger copy: the result the task stored in S3 before sending it, if there is one ('copy'), else
        lost(ledger rows) ('lost'; None: land nothing). A row that landed meanwhile wins (the attempt's key)."""
        rows = self.ledger_copy(ref)
        copy = self.result_copy(ref)
        if copy is None and lost is None:
            return None
        seen = {r.get("call_id") for r in rows}
        rows += [r for r in (copy.rows if copy is not None else []) if r.get("call_id") not in seen]
        if copy is not None:
            try:
                self.enqueue_eval(self._land_refusing_rows(copy.msg, rows))
                return "copy"
            except (psycopg.DataError, psycopg.IntegrityError) as e:
                if lost is None:
                    raise
                log.error("the S3 result copy of %s was refused by the database (%s); it lands as lost", ref.slug, e)
        self.enqueue_eval(self._land_refusing_rows(lost(rows), rows))
        return "lost"

    def result_copy(self, ref: AttemptRef) -> Incoming | None:
        """The result message the task stored in S3 before sending it (None if it left none, or an unreadable one)."""
        got = aws.get_signed_if_exists(aws.result_copy_uri(self.res.artifacts_prefix(ref)))
        if got is None:
            return None
        text, signature = got
        try:
            msg = Incoming.decode(text)
        except Undeliverable as e:
            log.error("the S3 result copy of %s is unreadable: %s", ref.slug, e)
            return None
        if not (isinstance(msg.msg, AttemptResult) and msg.msg.ref == ref):
            return None
        if why := self.auth.attempt_refusal(text, signature, msg):
            log.error("the S3 result copy of %s is refused: %s", ref.slug, why)
            return None
        return msg

    def _land_refusing_rows(self, msg: AttemptResult, rows: list[dict[str, Any]]) -> list[AttemptRef]:
        """The attempt with its rows; if the database refuses a row, the attempt alone (its row must land)."""
        try:
            return self.land([Incoming(msg, rows)])
        except (psycopg.DataError, psycopg.IntegrityError) as e:
            if not rows:
                raise
            log.error("ledger rows of %s refused by the database (%s); its attempt lands without them",
                      msg.ref.slug, e)
            return self.land([Incoming(msg)])

    # ------------------------------------------------------------ eval jobs

    def enqueue_eval(self, refs: list[AttemptRef]) -> None:
        for ref in refs:
            row = self.conn.execute(
                "SELECT patch_uri, model FROM attempts WHERE run=%s AND instance_id=%s AND attempt=%s AND status='PATCH_READY'",
                (ref.run, ref.instance_id, ref.attempt),
            ).fetchone()
            self.conn.commit()
            if row is None or not row[0]:
                continue  # graded meanwhile, or never a patch: an empty patch never reaches the grader
            job = Job.model_validate_json(aws.get_text(self.res.job_uri(ref)))
            ej = EvalJob(
                ref=ref, model_name=row[1], patch_uri=row[0], instance=job.instance,
                repo_source=job.bundle or job.repo_source,
                verdict_queue_url=self.res.verdict_queue_url, artifacts_prefix=self.res.artifacts_prefix(ref),
                timeout_s=self.eval_timeout_s,
            )
            aws.send(self.res.eval_queue_url, ej.model_dump_json())
            self.conn.execute(
                "UPDATE attempts SET eval_enqueued_at = now() WHERE run=%s AND instance_id=%s AND attempt=%s",
                (ref.run, ref.instance_id, ref.attempt),
            )
            self.conn.commit()

    def sweep(self) -> int:
        """Enqueue eval jobs for PATCH_READY attempts whose job was committed but never sent (crash recovery)."""
        rows = self.conn.execute(
            "SELECT instance_id, attempt FROM attempts WHERE run=%s AND status='PATCH_READY' AND eval_enqueued_at IS NULL",
            (self.res.run,),
        ).fetchall()
        self.conn.commit()
        refs = [AttemptRef(run=self.res.run, instance_id=i, attempt=a) for i, a in rows]
        self.enqueue_eval(refs)
        return len(refs)

    # ------------------------------------------------------------ the loop

    def poll_once(self, wait_s: int = 1, max_messages: int | None = None) -> int:
        """The results queue (tasks' messages), then the verdict queue (the eval fleet's): see _poll."""
        limit = max_messages or self.BATCH_MESSAGES
        return (self._poll(self.res.results_queue_url, wait_s, limit)
                + self._poll(self.res.verdict_queue_url, 0, limit))

    def _poll(self, queue_url: str, wait_s: int, limit: int) -> int:
        """Receive what the queue holds, ten a call, up to limit (waiting only for the first ten), dead-letter those
        that may not land (message_auth), land the rest in one transaction."""
        sqs = aws.client("sqs")
        msgs: list[dict] = []
        t = time.monotonic()
        while len(msgs) < limit:
            got = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=min(10, limit - len(msgs)),
                                      MessageAttributeNames=RECEIVE_ATTRIBUTES,
                                      WaitTimeSeconds=0 if msgs else wait_s).get("Messages", [])
            msgs += got
            if len(got) < 10:
                break
        if not msgs:
            return 0
        self.batches += 1
        t = self._clock("receive", t)
        batch, keep, forged = [], [], []
        for m in msgs:
            try:
                incoming = Incoming.decode(m["Body"])
            except Undeliverable as e:
                log.error("%s; left for the dead-letter queue", e)
                continue
            if why := self.auth.refusal(queue_url, m["Body"], signature_of(m), incoming):
                forged.append((m, why))
            else:
                batch.append(incoming)
                keep.append(m)
        if forged:
            self.auth.dead_letter(sqs, queue_url, forged)
        t = self._clock("decode", t)
        try:
            ready = self.land(batch)
        except (psycopg.DataError, psycopg.IntegrityError):
            ready, refused = self.land_each(batch)
            keep = [m for i, m in enumerate(keep) if i not in refused]
        t = self._clock("land", t)
        self.recover_ledgers([m.msg.ref for m in batch if isinstance(m.msg, AttemptResult)
                              and m.msg.outcome is HarnessOutcome.INFRA_ERROR and m.msg.ledger_calls == 0])
        self.enqueue_eval(ready)
        t = self._clock("enqueue eval", t)
        for i in range(0, len(keep), 10):
            sqs.delete_message_batch(
                QueueUrl=queue_url,
                Entries=[{"Id": str(j), "ReceiptHandle": m["ReceiptHandle"]} for j, m in enumerate(keep[i:i + 10])],
            )
        self._clock("delete", t)
        return len(keep) + len(forged)

    def _clock(self, stage: str, since: float) -> float:
        now = time.monotonic()
        self.busy_s[stage] += now - since
        return now

    def run_until(self, stop: threading.Event) -> None:
        self.sweep()
        while not stop.is_set():
            try:
                self.poll_once(wait_s=1)
            except Exception:  # keep landing: a transient DB or queue error must not stop the writer
                log.exception("results writer iteration failed; retrying")
                stop.wait(1.0)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def state(self) -> dict:
        return {"run": self.res.run, "landed": dict(self.landed), "batches": self.batches,
                "redelivered_batches": self.redelivered_batches,
                "busy_s": {k: round(v, 3) for k, v in self.busy_s.items()}}

