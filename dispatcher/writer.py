"""The results writer: consume the run's results queue, land rows idempotently, then delete the messages.

Order per batch: land every message's rows in one transaction and commit; enqueue eval jobs for
attempts that just became PATCH_READY and mark them enqueued; only then delete the messages. A crash
anywhere re-delivers the batch and the unique keys absorb the repeats; `sweep()` re-enqueues eval
jobs that were committed but never sent.
"""

from __future__ import annotations

import logging
import operator
import threading

import psycopg
from psycopg.types.json import Jsonb

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
)
from dispatcher.resources import RunResources

log = logging.getLogger("evalplane.writer")

_CALL_COLUMNS = (
    "call_id", "run", "instance_id", "attempt", "seq", "pool", "provider", "model", "route", "stream", "started_at",
    "input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens", "cost_usd", "latency_ms",
    "pacer_wait_ms", "retries", "http_status", "outcome", "usage_estimated", "raw_usage",
)


_ATTEMPT_COLUMNS = (
    "run", "instance_id", "attempt", "harness", "pool", "model", "outcome", "status", "patch_uri", "patch_bytes",
    "trajectory_uri", "calls", "input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens", "cost_usd",
    "wall_time_s", "started_at", "ended_at", "error",
)


_call_fields = operator.attrgetter(*_CALL_COLUMNS)
_RAW_USAGE = _CALL_COLUMNS.index("raw_usage")


_ATTEMPT_TYPES = ("text", "text", "int", "text", "text", "text", "text", "text", "text", "int", "text", "int", "bigint",
                  "bigint", "bigint", "bigint", "numeric", "float8", "timestamptz", "timestamptz", "text")
# One statement per batch: the columns as arrays, unnested; DISTINCT ON drops a repeat inside the batch.
_INSERT_ATTEMPTS = (
    f"INSERT INTO attempts ({', '.join(_ATTEMPT_COLUMNS)}) SELECT DISTINCT ON (run, instance_id, attempt) * FROM unnest("
    + ", ".join(f"%s::{t}[]" for t in _ATTEMPT_TYPES)
    + f") AS t({', '.join(_ATTEMPT_COLUMNS)}) ON CONFLICT (run, instance_id, attempt) DO NOTHING"
    " RETURNING run, instance_id, attempt, status"
)


def _call_row(r: CallRecord) -> tuple:
    row = list(_call_fields(r))
    if row[_RAW_USAGE] is not None:
        row[_RAW_USAGE] = Jsonb(row[_RAW_USAGE])
    return tuple(row)


_VERDICT_STATUS = {
    EvalOutcome.RESOLVED: AttemptStatus.RESOLVED,
    EvalOutcome.UNRESOLVED: AttemptStatus.UNRESOLVED,
}


class ResultsWriter:
    def __init__(self, res: RunResources, database_url: str, eval_timeout_s: float = 1800.0):
        self.res = res
        self.database_url = database_url
        self.eval_timeout_s = eval_timeout_s
        self.landed = {"ledger": 0, "attempt_result": 0, "verdict": 0}
        self._conn: psycopg.Connection | None = None

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.database_url)
            with self._conn.transaction():  # staging tables for COPY, once per session
                self._conn.execute("CREATE TEMP TABLE calls_stage (LIKE calls INCLUDING DEFAULTS) ON COMMIT DELETE ROWS")
        return self._conn

    # ------------------------------------------------------------ landing

    def land(self, messages: list[Envelope]) -> list[AttemptRef]:
        """Land a batch in one transaction; return the attempts that became PATCH_READY."""
        ready: list[AttemptRef] = []
        with self.conn.transaction(), self.conn.cursor() as cur:
            rows = [_call_row(r) for m in messages if isinstance(m.msg, (LedgerBatch, AttemptResult))
                    for r in (m.msg.rows if isinstance(m.msg, LedgerBatch) else m.msg.ledger)]
            if rows:
                self._copy_calls(cur, rows)
            results = [m.msg for m in messages if isinstance(m.msg, AttemptResult)]
            if results:
                ready = self._land_attempts(cur, results)
            for m in messages:
                if isinstance(m.msg, Verdict):
                    self._land_verdict(cur, m.msg)
        for m in messages:
            self.landed[m.msg.kind] += 1
        return ready

    @staticmethod
    def _copy_calls(cur, rows: list[tuple]) -> None:
        """COPY straight into the ledger; only if a row is already there (a redelivered batch) fall back to COPY
        into a staging table and one INSERT .. ON CONFLICT DO NOTHING, so the call_id key absorbs the repeat."""
        cols = ", ".join(_CALL_COLUMNS)
        try:
            with cur.connection.transaction():  # a savepoint: the fast path's failure costs nothing else
                with cur.copy(f"COPY calls ({cols}) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
            return
        except psycopg.errors.UniqueViolation:
            pass
        with cur.copy(f"COPY calls_stage ({cols}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cur.execute("INSERT INTO calls SELECT * FROM calls_stage ON CONFLICT (call_id) DO NOTHING")

    @staticmethod
    def _land_attempts(cur, results: list[AttemptResult]) -> list[AttemptRef]:
        """The batch's attempt rows in one INSERT .. ON CONFLICT DO NOTHING RETURNING, which tells which are new (a
        redelivery returns nothing); only those get their harness phase row, in one more statement. Returns the
        attempts that became PATCH_READY."""
        rows = []
        for r in results:
            if r.outcome is HarnessOutcome.CANCELLED:
                status = AttemptStatus.CANCELLED  # never graded
            else:
                status = AttemptStatus.PATCH_READY if r.patch_bytes > 0 else AttemptStatus.EMPTY_PATCH
            rows.append((
                r.ref.run, r.ref.instance_id, r.ref.attempt, r.harness, r.pool, r.model, r.outcome.value,
                status.value, r.patch_uri, r.patch_bytes, r.trajectory_uri, r.totals.calls, r.totals.input_tokens,
                r.totals.cached_tokens, r.totals.cache_write_tokens, r.totals.output_tokens, r.totals.cost_usd,
                (r.ended_at - r.started_at).total_seconds(), r.started_at, r.ended_at, r.error,
            ))
        cols = list(zip(*rows))
        cur.execute(_INSERT_ATTEMPTS, [list(c) for c in cols])
        new = {(r, i, a): st for r, i, a, st in cur.fetchall()}
        ready = [AttemptRef(run=r, instance_id=i, attempt=a) for (r, i, a), st in new.items()
                 if st == AttemptStatus.PATCH_READY.value]
        phases = {(r.ref.run, r.ref.instance_id, r.ref.attempt): r for r in results}
        mine = [phases[k] for k in new]
        if mine:
            cur.execute(
                """INSERT INTO phases (run, instance_id, attempt, phase, started_at, ended_at, outcome, detail)
                   SELECT run, iid, att, 'harness', s, e, o, d
                   FROM unnest(%s::text[], %s::text[], %s::int[], %s::timestamptz[], %s::timestamptz[], %s::text[],
                               %s::jsonb[]) AS t(run, iid, att, s, e, o, d)
                   ON CONFLICT DO NOTHING""",
                [[r.ref.run for r in mine], [r.ref.instance_id for r in mine], [r.ref.attempt for r in mine],
                 [r.started_at for r in mine], [r.ended_at for r in mine], [r.outcome.value for r in mine],
                 [Jsonb({"ledger_calls": r.ledger_calls, "error": r.error}) for r in mine]])
        return ready

    def _land_verdict(self, cur, v: Verdict) -> None:
        status = _VERDICT_STATUS.get(v.outcome, AttemptStatus.EVAL_ERROR)
        cur.execute(
            """UPDATE attempts SET status = %s, eval_outcome = %s, resolved = %s, report = %s
               WHERE run = %s AND instance_id = %s AND attempt = %s AND status = 'PATCH_READY'""",
            (status.value, v.outcome.value, v.resolved, Jsonb(v.report), v.ref.run, v.ref.instance_id, v.ref.attempt),
        )
        if cur.rowcount:
            cur.execute(
                "INSERT INTO phases (run, instance_id, attempt, phase, started_at, ended_at, outcome, detail)"
                " VALUES (%s,%s,%s,'eval',%s,%s,%s,%s) ON CONFLICT DO NOTHING",
                (v.ref.run, v.ref.instance_id, v.ref.attempt, v.started_at, v.ended_at, v.outcome.value,
                 Jsonb({"reason": v.reason, "report_uri": v.report_uri})),
            )

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
                ref=ref, model_name=row[1], patch_uri=row[0], instance=job.instance, repo_source=job.repo_source,
                results_queue_url=self.res.results_queue_url, artifacts_prefix=self.res.artifacts_prefix(ref),
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

    def poll_once(self, wait_s: int = 1, max_receives: int = 5) -> int:
        """Receive up to max_receives x 10 messages (waiting only for the first ten), land them in one transaction."""
        sqs = aws.client("sqs")
        msgs: list[dict] = []
        for i in range(max_receives):
            got = sqs.receive_message(QueueUrl=self.res.results_queue_url, MaxNumberOfMessages=10,
                                      WaitTimeSeconds=wait_s if i == 0 else 0).get("Messages", [])
            msgs += got
            if len(got) < 10:
                break
        if not msgs:
            return 0
        envelopes, bad = [], []
        for m in msgs:
            try:
                envelopes.append(Envelope.model_validate_json(m["Body"]))
            except ValueError as e:
                log.error("unreadable results message left for the dead-letter queue: %s", e)
                bad.append(m)
        ready = self.land(envelopes)
        self.enqueue_eval(ready)
        good = [m for m in msgs if m not in bad]
        for i in range(0, len(good), 10):
            sqs.delete_message_batch(
                QueueUrl=self.res.results_queue_url,
                Entries=[{"Id": str(j), "ReceiptHandle": m["ReceiptHandle"]} for j, m in enumerate(good[i:i + 10])],
            )
        return len(good)

    def run_until(self, stop: threading.Event) -> None:
        self.sweep()
        while not stop.is_set():
            try:
                self.poll_once(wait_s=1)
            except Exception:  # keep landing: a transient DB or queue error must not stop the writer
                log.exception("results writer iteration failed; retrying")
                stop.wait(1.0)

    def state(self) -> dict:
        return {"run": self.res.run, "landed": dict(self.landed)}

