"""A run's place in the gateway tier, as the dispatcher opens and closes it: the pool's alias registered with its
deployments, the run's key minted (scoped to that alias, expiring, carrying the run's cap as its budget where no
provider key per run holds it: dispatcher/provider_keys), and at the run's end (finished, cancelled or failed) the
key revoked."""

from __future__ import annotations

import hashlib
import json
import time

import psycopg
from pydantic import BaseModel

from contract import signing
from gateway import aliases, keys
from gateway.runtime import meter_keys


class RunGateway(BaseModel):
    url: str  # the gateway, as the dispatcher reaches it
    alias: str  # the pool's name at the gateway: what the shims send as the model
    key: str  # the run's gateway key: the only upstream credential its tasks get


def key_name(provider_key: str) -> str:
    """A provider key's name in the gateway's key file: a digest, so that names reveal nothing and one key
    registered twice is one entry."""
    return "key-" + hashlib.sha256(provider_key.encode()).hexdigest()[:16]


def deployment(provider: str, model: str, upstream_url: str, key_name: str) -> aliases.Deployment:
    """The deployment of `model` at `upstream_url` (the base URL the shim would call directly). LiteLLM appends
    /chat/completions to an OpenAI api_base and /v1/messages to an Anthropic one."""
    base = upstream_url.rstrip("/").removesuffix("/v1")
    return aliases.Deployment(model=f"{provider}/{model}", api_base=base + "/v1" if provider == "openai" else base,
                              key_name=key_name)


def open_run(conn: psycopg.Connection, valkey, spec, run_secret: bytes, url: str, alias: str,
             deployments: list[aliases.Deployment], budget_usd: float | None) -> RunGateway:
    aliases.register(conn, alias, deployments)
    key = signing.gateway_key(run_secret)
    keys.mint(conn, valkey, key, keys.KeyRecord(owner=spec.run.name, aliases=[alias], budget_usd=budget_usd,
                                                expires_at=keys.expiry(spec.gateway.key_ttl_s)))
    return RunGateway(url=url, alias=alias, key=key)


def close_run(conn: psycopg.Connection, valkey, run: str) -> bool:
    """Revoke the run's key, then wait for its calls' meter rows still in Valkey to land (a replica drains them
    within a second, or a drain lease after a replica died): the run's report then reconciles every call. False if
    some were still waiting at the deadline (the reconciliation shows them; `report` later finds them landed)."""
    keys.revoke(conn, valkey, run)
    return meter_drained(conn, valkey, run)


def meter_drained(conn: psycopg.Connection, valkey, owner: str, timeout_s: float = 30.0) -> bool:
    """True once no meter row of `owner` waits in Valkey for the drain to PostgreSQL."""
    rows_key, _ = meter_keys(conn.info.host, conn.info.port, conn.info.dbname)
    deadline = time.monotonic() + timeout_s
    while any(json.loads(r).get("owner") == owner for r in valkey.lrange(rows_key, 0, -1)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def put_provider_key(key_file, provider_key: str) -> str:
    """`provider_key` into the local tier's 0600 key file (gateway.keyfile) under its digest name: that name, which a
    deployment carries instead of the key."""
    from gateway import keyfile

    name = key_name(provider_key)
    keyfile.put(key_file, name, provider_key)
    return name


def open_owner(conn: psycopg.Connection, valkey, owner: str, url: str, alias: str,
               deployments: list[aliases.Deployment], key: str, budget_usd: float | None,
               ttl_s: float) -> RunGateway:
    """A key of `owner`'s own (the judge's: a fresh one per pass) with `budget_usd`, scoped to `alias` and its
    deployments. The owner's earlier keys are revoked first: mint replaces only the PostgreSQL row, and a killed
    pass's key would otherwise stay live in Valkey until it expires."""
    aliases.register(conn, alias, deployments)
    keys.revoke(conn, valkey, owner)
    keys.mint(conn, valkey, key, keys.KeyRecord(owner=owner, aliases=[alias], budget_usd=budget_usd,
                                                expires_at=keys.expiry(ttl_s)))
    return RunGateway(url=url, alias=alias, key=key)
