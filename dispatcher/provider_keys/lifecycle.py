"""A run's provider key, from its start to its end: minted with the run's cap as its spend limit (a resumed run
finds its key again), its usage recorded and the key revoked when the run ends."""

from __future__ import annotations

import psycopg

from dispatcher import store
from dispatcher.provider_keys import PROVIDER_KEYS


def open_key(conn: psycopg.Connection, provider: str, base_url: str, admin_key: str, run: str,
             limit_usd: float | None, key_name) -> tuple[str, str | None]:
    """(the key's name in the gateway's key file, the new key to put there: None when the run's live key is
    there already). key_name(secret) names a key."""
    row = store.provider_key(conn, run)
    if row is not None and row.revoked_at is None and row.provider == provider:
        return row.key_name, None
    minted = PROVIDER_KEYS.get(provider)(base_url, admin_key).mint(f"run:{run}", limit_usd)
    name = key_name(minted.key)
    store.record_provider_key(conn, run, provider, minted.id, name, limit_usd)
    return name, minted.key


def close_key(conn: psycopg.Connection, base_url: str, admin_key: str, run: str) -> None:
    """The run's key: its usage recorded (the third meter), then revoked at the provider."""
    row = store.provider_key(conn, run)
    if row is None or row.revoked_at is not None:
        return
    keys = PROVIDER_KEYS.get(row.provider)(base_url, admin_key)
    usage = keys.usage(row.key_id)
    keys.revoke(row.key_id)
    store.close_provider_key(conn, run, usage.model_dump())
