"""PostgreSQL access shared by the writer and the CLI: connection and versioned migrations."""

from __future__ import annotations

import os
import re
from importlib import resources

import psycopg

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
_MIGRATION = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_LOCK_ID = 0x65706C616E65  # "eplane": serialises concurrent migrators


def database_url() -> str:
    """DATABASE_URL; or, in the estate's ECS tasks (judge, gateway), the parts their task definition gives (host and
    database name in the environment, user and password from the Aurora secret)."""
    if url := os.environ.get("DATABASE_URL"):
        return url
    if host := os.environ.get("DATABASE_HOST"):
        from psycopg.conninfo import make_conninfo

        return make_conninfo(host=host, port=os.environ.get("DATABASE_PORT", "5432"),
                             dbname=os.environ.get("DATABASE_NAME", "postgres"),
                             user=os.environ.get("DATABASE_USERNAME"), password=os.environ.get("DATABASE_PASSWORD"),
                             sslmode="require")
    return DEFAULT_DATABASE_URL


def connect(url: str | None = None, **kw) -> psycopg.Connection:
    return psycopg.connect(url or database_url(), **kw)


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every file in contract/migrations, in order."""
    found = []
    for entry in resources.files("contract.migrations").iterdir():
        m = _MIGRATION.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry.name, entry.read_text()))
    return sorted(found)


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply pending migrations, each in its own transaction; safe to call concurrently and repeatedly."""
    applied: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_ID,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r[0] for r in conn.execute("SELECT version FROM schema_migrations")}
        for version, name, sql in migrations():
            if version in done:
                continue
            conn.execute(sql)
            conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
            applied.append(name)
    return applied
