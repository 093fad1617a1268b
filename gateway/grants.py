"""The replicas' own PostgreSQL role on an estate: they read keys and aliases and add meter rows, nothing else (the
dispatcher, which owns the database, makes the role from the estate's secret; locally the replicas share its URL)."""

from __future__ import annotations

import psycopg
from psycopg import sql

READ = ("gateway_keys", "gateway_aliases")
APPEND = ("gateway_calls",)


def ensure_replica_role(conn: psycopg.Connection, user: str, password: str) -> None:
    """`user` logs in with `password` (set again: the secret is the truth) and holds only the replicas' grants."""
    role = sql.Identifier(user)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('gateway replica role', 0))")
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,)).fetchone()
        verb = sql.SQL("ALTER ROLE {} WITH LOGIN PASSWORD {}" if exists else "CREATE ROLE {} WITH LOGIN PASSWORD {}")
        conn.execute(verb.format(role, sql.Literal(password)))
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(sql.SQL(", ").join(map(sql.Identifier, READ)), role))
        conn.execute(sql.SQL("GRANT INSERT ON {} TO {}").format(sql.SQL(", ").join(map(sql.Identifier, APPEND)), role))
