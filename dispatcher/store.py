"""The runs as the command line reads and changes them: the SQL its commands run, and the one way they open the
database (migrated once per process, and a refused connection raised as StackDown, not psycopg's traceback)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb

from contract import db
from shim.hold import set_hold

CONNECT_TIMEOUT_S = 10  # an unreachable host (not a refused port) would otherwise wait for the kernel's timeout
_migrated = False


class StackDown(Exception):
    """A part of the local stack (PostgreSQL, Valkey) a command needs does not answer."""

    def __init__(self, what: str, where: str, why: str):
        self.what, self.where, self.why = what, where, why
        super().__init__(f"cannot connect to {what}" + (f" at {where}" if where else "") + f" ({why})")


def where(url: str) -> str:
    """host:port/database of a PostgreSQL URL, without its credentials."""
    try:
        d = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "an unparseable DATABASE_URL"
    return f"{d.get('host', 'localhost')}:{d.get('port', 5432)}/{d.get('dbname', '')}"


@contextmanager
def connect() -> Iterator[psycopg.Connection]:
    """A connection to the runs' database (commits on a clean exit); the first in a process applies migrations."""
    global _migrated
    url = db.database_url()
    try:
        conn = db.connect(url, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.OperationalError as e:
        raise StackDown("PostgreSQL", where(url), _first_line(e)) from None
    with conn:
        if not _migrated:
            db.migrate(conn)
            _migrated = True
        yield conn


def _first_line(e: Exception) -> str:
    """psycopg's cause without its preamble: 'connection failed: connection to server at ... failed: CAUSE'."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return line.rsplit(" failed: ", 1)[-1].strip()


def run_exists(conn: psycopg.Connection, run: str) -> bool:
    return conn.execute("SELECT 1 FROM runs WHERE run = %s", (run,)).fetchone() is not None


def run_status(conn: psycopg.Connection, run: str) -> str | None:
    row = conn.execute("SELECT status FROM runs WHERE run = %s", (run,)).fetchone()
    return row[0] if row else None


def stored_spec(conn: psycopg.Connection, run: str) -> tuple[str, dict] | None:
    """(backend kind, the spec as the run stored it), or None for no such run."""
    row = conn.execute("SELECT backend, spec FROM runs WHERE run = %s", (run,)).fetchone()
    return (row[0], row[1]) if row else None


def cancel(conn: psycopg.Connection, run: str) -> bool:
    """Mark a running run cancelled (its driver acts on it); False if no run of that name is running."""
    cur = conn.execute("UPDATE runs SET status = 'cancelled' WHERE run = %s AND status = 'running'", (run,))
    return cur.rowcount > 0


@dataclass(frozen=True)
class Control:
    """What a run's operators set while it goes (`pause`, `resume`, `resize`, `cancel`); its driver reads it every
    pass."""

    status: str
    paused: bool
    hold_calls: bool  # `pause --hold-calls`: the shims hold each new model call too
    concurrency: int | None  # the ceiling `resize` set; None: the spec's backend.concurrency
    retries: int  # attempts `retry` added to the run


def control(conn: psycopg.Connection, run: str) -> Control | None:
    row = conn.execute("SELECT status, paused, hold_calls, concurrency,"
                       " (SELECT count(*) FROM retries WHERE run = %s) FROM runs WHERE run = %s", (run, run)).fetchone()
    return Control(*row) if row else None


def set_paused(conn: psycopg.Connection, run: str, paused: bool, hold_calls: bool = False, valkey=None) -> bool:
    """Pause or resume a running run; False if no run of that name is running. A pause with hold_calls also holds
    the shims' new model calls; a later pause without it keeps the hold: only the resume lifts it.

    The hold reaches the shims through Valkey (shim/hold.py), written here with the run's row locked, so the key
    and the row agree whoever writes last (a command, the dashboard, a driver restoring it: sync_hold). `valkey`,
    a client that may write the key, is needed to set or lift a hold (ValueError without it)."""
    row = conn.execute("SELECT hold_calls FROM runs WHERE run = %s AND status = 'running' FOR UPDATE",
                       (run,)).fetchone()
    if row is None:
        return False
    hold = paused and (hold_calls or row[0])
    if hold != row[0] and valkey is None:
        raise ValueError(f"run {run!r}: a call hold is set and lifted in Valkey, and no Valkey client was given")
    if valkey is not None:  # also where the hold stays as it was: the key as the row says
        set_hold(valkey, run, hold)
    conn.execute("UPDATE runs SET paused = %s, hold_calls = %s WHERE run = %s", (paused, hold, run))
    return True


def sync_hold(conn: psycopg.Connection, valkey, run: str) -> bool:
    """Make the run's call hold in Valkey what its row says (a running run's hold_calls), with the row locked as
    set_paused does: a driver started again honours a hold whose key a restarted Valkey lost, and lifts one a run
    cancelled while held left. True if the run's calls are held. The caller commits."""
    row = conn.execute("SELECT hold_calls AND status = 'running' FROM runs WHERE run = %s FOR UPDATE",
                       (run,)).fetchone()
    hold = bool(row and row[0])
    set_hold(valkey, run, hold)
    return hold


def resize(conn: psycopg.Connection, run: str, concurrency: int) -> bool:
    """Set the concurrency ceiling of a run that is not finished; False if there is no such run."""
    cur = conn.execute("UPDATE runs SET concurrency = %s WHERE run = %s AND status = 'running'", (concurrency, run))
    return cur.rowcount > 0


def act(conn: psycopg.Connection, run: str, action: str, concurrency: int | None = None, valkey=None,
        hold_calls: bool = False) -> bool:
    """One control action by name (the dashboard's requests); False if no run of that name is running. `valkey`:
    as set_paused needs it (a pause with hold_calls sets a call hold, a resume lifts one)."""
    if action == "resize":
        return resize(conn, run, concurrency)
    if action == "cancel":
        return cancel(conn, run)
    return set_paused(conn, run, action == "pause", hold_calls=hold_calls, valkey=valkey)


def spent_usd(conn: psycopg.Connection, run: str) -> float:
    """What the run's attempts have spent on tokens, as their rows record it."""
    return float(conn.execute("SELECT coalesce(sum(cost_usd), 0) FROM attempts WHERE run = %s", (run,)).fetchone()[0])


def current_attempts(conn: psycopg.Connection, run: str) -> list[dict]:
    """The run's attempts that no later attempt of their slot has superseded, with their latest verdict:
    instance_id, attempt, slot, status, error, report, and whether a retry of it is already recorded (replaced)."""
    cur = conn.execute(
        """SELECT a.instance_id, a.attempt, v.slot, v.status, a.error, v.report,
                  EXISTS (SELECT 1 FROM retries r WHERE r.run = a.run AND r.instance_id = a.instance_id
                          AND r.replaces = a.attempt) AS replaced FROM attempts a
           JOIN attempt_verdicts v USING (run, instance_id, attempt)
           WHERE a.run = %s AND NOT v.superseded ORDER BY a.instance_id, v.slot""", (run,))
    cols = [d.name for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def add_retries(conn: psycopg.Connection, run: str, picks: list[tuple[str, int, int, str]]) -> list[tuple[str, int]]:
    """Record each (instance_id, attempt, slot, reason) as relaunched under the instance's next attempt number;
    reopens the run (its driver launches them). Returns the new (instance_id, attempt) pairs."""
    new = []
    for iid, attempt, slot, reason in picks:
        (n,) = conn.execute(
            """SELECT greatest((SELECT coalesce(max(attempt), 0) FROM attempts WHERE run = %s AND instance_id = %s),
                               (SELECT coalesce(max(attempt), 0) FROM retries WHERE run = %s AND instance_id = %s),
                               (SELECT coalesce((spec->'run'->>'attempts')::int, 1) FROM runs WHERE run = %s)) + 1""",
            (run, iid, run, iid, run)).fetchone()
        conn.execute("INSERT INTO retries (run, instance_id, attempt, slot, replaces, reason) VALUES"
                     " (%s, %s, %s, %s, %s, %s)", (run, iid, n, slot, attempt, reason))
        new.append((iid, n))
    if new:
        conn.execute("UPDATE runs SET status = 'running', finished_at = NULL WHERE run = %s AND status = 'finished'",
                     (run,))
    return new


def retry_reason(conn: psycopg.Connection, ref) -> str | None:
    """Why the attempt was relaunched, if it is a retry (the class its predecessor ended in)."""
    row = conn.execute("SELECT reason FROM retries WHERE run = %s AND instance_id = %s AND attempt = %s",
                       (ref.run, ref.instance_id, ref.attempt)).fetchone()
    return row[0] if row else None


def retried(conn: psycopg.Connection, run: str) -> list[tuple[str, int]]:
    """Every attempt `retry` added to the run, (instance_id, attempt), in the order they were asked for."""
    return conn.execute("SELECT instance_id, attempt FROM retries WHERE run = %s ORDER BY requested_at, instance_id",
                        (run,)).fetchall()


def finish(conn: psycopg.Connection, run: str) -> None:
    """Mark a run whose attempts have all landed finished (a cancelled run stays cancelled), now."""
    conn.execute("UPDATE runs SET status = CASE WHEN status = 'cancelled' THEN status ELSE 'finished' END,"
                 " finished_at = now() WHERE run = %s", (run,))
    conn.commit()


def attempts_landed(conn: psycopg.Connection, run: str) -> int:
    return conn.execute("SELECT count(*) FROM attempts WHERE run = %s", (run,)).fetchone()[0]


@dataclass(frozen=True)
class Progress:
    run: str
    status: str
    planned: int
    landed: int
    resolved: int
    cost_usd: float
    created_at: datetime
    paused: bool
    hold_calls: bool
    concurrency: int | None


def progress(conn: psycopg.Connection, run: str | None = None) -> list[Progress]:
    """Every run's progress (or one run's), oldest first."""
    rows = conn.execute(
        """SELECT r.run, r.status, r.attempts + (SELECT count(*) FROM retries x WHERE x.run = r.run), count(a.*),
                  count(a.*) FILTER (WHERE v.status = 'RESOLVED' AND NOT v.superseded),
                  coalesce(sum(a.cost_usd), 0), r.created_at, r.paused, r.hold_calls, r.concurrency
           FROM runs r LEFT JOIN attempts a USING (run) LEFT JOIN attempt_verdicts v USING (run, instance_id, attempt)
           WHERE %s::text IS NULL OR r.run = %s GROUP BY r.run ORDER BY r.created_at""",
        (run, run),
    ).fetchall()
    return [Progress(*r[:5], float(r[5]), *r[6:]) for r in rows]


_METER_TOKENS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")


def meter_pairs(conn: psycopg.Connection, run: str) -> list[dict]:
    """The run's calls as both meters saw them, matched by the gateway's call id: each shim ledger row with its
    gateway row (the g_ columns, NULL where the gateway has none), then each gateway row of the run no shim row
    names (its shim_ columns NULL). Gateway rows of refused calls (status error) are left out: they were never
    answered, so no meter charged them."""
    cols = ", ".join(f"c.{t} AS shim_{t}, g.{t} AS g_{t}" for t in (*_METER_TOKENS, "cost_usd"))
    cur = conn.execute(
        "WITH c AS (SELECT * FROM calls WHERE run = %s),"
        " g AS (SELECT * FROM gateway_calls WHERE owner = %s AND status = 'ok')"
        " SELECT c.call_id::text AS shim_call_id, c.gateway_call_id AS shim_gateway_call_id,"
        f" g.gateway_call_id AS g_gateway_call_id, g.deployment AS g_deployment, {cols}"
        " FROM c FULL JOIN g ON g.gateway_call_id = c.gateway_call_id ORDER BY c.started_at, g.started_at",
        (run, run))
    names = [d.name for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


@dataclass
class ProviderKeyRow:
    owner: str
    provider: str
    key_id: str
    key_name: str
    limit_usd: float | None
    usage: dict | None
    revoked_at: datetime | None


def provider_key(conn: psycopg.Connection, owner: str) -> ProviderKeyRow | None:
    row = conn.execute("SELECT owner, provider, key_id, key_name, limit_usd, usage, revoked_at FROM provider_keys"
                       " WHERE owner = %s", (owner,)).fetchone()
    conn.commit()
    if row is None:
        return None
    return ProviderKeyRow(*row[:4], None if row[4] is None else float(row[4]), *row[5:])


def record_provider_key(conn: psycopg.Connection, owner: str, provider: str, key_id: str, key_name: str,
                        limit_usd: float | None) -> None:
    with conn.transaction():
        conn.execute("INSERT INTO provider_keys (owner, provider, key_id, key_name, limit_usd) VALUES (%s, %s, %s, %s,"
                     " %s) ON CONFLICT (owner) DO UPDATE SET provider = excluded.provider, key_id = excluded.key_id,"
                     " key_name = excluded.key_name, limit_usd = excluded.limit_usd, usage = NULL, revoked_at = NULL,"
                     " created_at = now()", (owner, provider, key_id, key_name, limit_usd))


def close_provider_key(conn: psycopg.Connection, owner: str, usage: dict) -> None:
    with conn.transaction():
        conn.execute("UPDATE provider_keys SET usage = %s, revoked_at = now() WHERE owner = %s",
                     (Jsonb(usage), owner))
