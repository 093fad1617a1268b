"""How a command fails: its exit codes, and the one place a failure becomes a line on stderr (`explain`, called by
the app's boundary in dispatcher.cli.main) instead of a traceback."""

from __future__ import annotations

import psycopg
import redis
from rich.markup import escape

from contract import db
from dispatcher import store
from dispatcher.spec import SpecError

EXIT_FAILED = 1
EXIT_SPEC = 2  # the spec (or an argument) is wrong: nothing was started
EXIT_CONFLICT = 3  # another driver holds the run
EXIT_STACK_DOWN = 4  # PostgreSQL or Valkey does not answer
START_STACK = "scripts/stack.sh up"


class Refused(Exception):
    """A command declines, for a reason its user can act on: one line, an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        self.message, self.code = message, code
        super().__init__(message)


def explain(e: BaseException) -> tuple[list[str], int] | None:
    """The lines (rich markup) and exit code for a failure a user can act on; None for anything else (a bug: its
    traceback is the useful report)."""
    if isinstance(e, Refused):
        return [f"[bold red]error:[/] {escape(e.message)}"], e.code
    if isinstance(e, SpecError):
        return [f"[bold red]{len(e.problems)} problem(s) in {escape(e.file)}:[/]",
                *(f"  {escape(str(p))}" for p in e.problems)], EXIT_SPEC
    if isinstance(e, psycopg.OperationalError) and e.sqlstate is None:  # no SQLSTATE: the connection, not a query
        url = db.database_url()
        e = store.StackDown("PostgreSQL", store.where(url), str(e).strip().splitlines()[0] if str(e).strip() else "")
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
        e = store.StackDown("Valkey", "", str(e))  # redis names the host and port
    if isinstance(e, store.StackDown):
        return [f"[bold red]error:[/] {escape(str(e))}; the local stack starts with `{START_STACK}`"], EXIT_STACK_DOWN
    return None
