"""Gateway keys: one per run (or the judge), stored hashed, scoped to aliases, with an expiry and a revocation.

PostgreSQL holds the record; Valkey holds the live ones (expiring with them) for the replicas' hot path. A key missing
from Valkey is looked up in PostgreSQL and cached again, so a Valkey restart refuses nothing it should serve.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta

import psycopg
from pydantic import BaseModel

from contract import keys


class KeyRecord(BaseModel):
    owner: str
    aliases: list[str]
    budget_usd: float | None = None
    expires_at: datetime

    def expired(self) -> bool:
        return self.expires_at <= datetime.now(UTC)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _cache(valkey, h: str, rec: KeyRecord):
    """The Valkey copy of a live key, expiring when it does (a pipeline or client: the caller executes it)."""
    valkey.set(keys.gateway_key(h), rec.model_dump_json(), pxat=int(rec.expires_at.timestamp() * 1000))


def mint(conn: psycopg.Connection, valkey, key: str, rec: KeyRecord) -> None:
    """Record `key` for rec.owner (replacing the owner's earlier key, revoked or not) and make it live."""
    h = key_hash(key)
    with conn.transaction():
        conn.execute("DELETE FROM gateway_keys WHERE owner = %s", (rec.owner,))
        conn.execute("INSERT INTO gateway_keys (key_hash, owner, aliases, budget_usd, expires_at)"
                     " VALUES (%s, %s, %s, %s, %s)", (h, rec.owner, rec.aliases, rec.budget_usd, rec.expires_at))
    _cache(valkey, h, rec)


def revoke(conn: psycopg.Connection, valkey, owner: str) -> None:
    """The owner's key is refused from now on, by every replica."""
    with conn.transaction():
        rows = conn.execute("UPDATE gateway_keys SET revoked_at = now() WHERE owner = %s AND revoked_at IS NULL"
                            " RETURNING key_hash", (owner,)).fetchall()
    for (h,) in rows:
        valkey.delete(keys.gateway_key(h))


def expiry(ttl_s: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=ttl_s)


# A live key's row by its hash (the replicas run it async, gateway/runtime.py; from_database here)
LIVE_KEY_SQL = ("SELECT owner, aliases, budget_usd, expires_at FROM gateway_keys"
                " WHERE key_hash = %s AND revoked_at IS NULL AND expires_at > now()")


def record_of(row: tuple | None) -> KeyRecord | None:
    if row is None:
        return None
    return KeyRecord(owner=row[0], aliases=row[1], budget_usd=None if row[2] is None else float(row[2]),
                     expires_at=row[3])


def from_database(conn: psycopg.Connection, h: str) -> KeyRecord | None:
    """A live key's record from PostgreSQL (None: unknown, revoked or expired)."""
    row = conn.execute(LIVE_KEY_SQL, (h,)).fetchone()
    conn.commit()
    return record_of(row)


def from_cache(raw: bytes | str | None) -> KeyRecord | None:
    return None if raw is None else KeyRecord.model_validate(json.loads(raw))
