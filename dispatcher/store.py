"""The runs as the command line reads and changes them: the SQL its commands run, and the one way they open the
database (migrated once per process, and a refused connection raised as StackDown, not psycopg's traceback)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.conninfo import conninfo_to_dict

from contract import db

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


def progress(conn: psycopg.Connection, run: str | None = None) -> list[Progress]:
    """Every run's progress (or one run's), oldest first."""
    rows = conn.execute(
        """SELECT r.run, r.status, r.attempts, count(a.*), count(a.*) FILTER (WHERE a.status = 'RESOLVED'),
                  coalesce(sum(a.cost_usd), 0), r.created_at
           FROM runs r LEFT JOIN attempts a USING (run)
           WHERE %s::text IS NULL OR r.run = %s GROUP BY r.run ORDER BY r.created_at""",
        (run, run),
    ).fetchall()
    return [Progress(r, s, p, n, ok, float(cost), t) for r, s, p, n, ok, cost, t in rows]
