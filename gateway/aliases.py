"""Aliases: one per (model, harness) pool, registered by the dispatcher with the deployments that serve it.

A deployment names its provider key (a name in the gateway's key file, gateway/keyfile.py), never the key: the
database and the dispatcher's records hold no provider secret.
"""

from __future__ import annotations

import psycopg
from psycopg.types.json import Jsonb
from pydantic import BaseModel, TypeAdapter


class Deployment(BaseModel):
    model: str  # LiteLLM's provider/model, e.g. "anthropic/claude-sonnet-4-5"
    api_base: str
    key_name: str  # the provider key's name in the gateway's key file

    @property
    def id(self) -> str:
        """Stable per (model, endpoint, key): the router's deployment id and the meter's `deployment`."""
        return f"{self.model}@{self.api_base}#{self.key_name}"


_DEPLOYMENTS = TypeAdapter(list[Deployment])


def register(conn: psycopg.Connection, alias: str, deployments: list[Deployment]) -> None:
    with conn.transaction():
        conn.execute("INSERT INTO gateway_aliases (alias, deployments) VALUES (%s, %s) ON CONFLICT (alias)"
                     " DO UPDATE SET deployments = excluded.deployments, updated_at = now()",
                     (alias, Jsonb(_DEPLOYMENTS.dump_python(deployments))))


def load(conn: psycopg.Connection, alias: str) -> list[Deployment]:
    row = conn.execute("SELECT deployments FROM gateway_aliases WHERE alias = %s", (alias,)).fetchone()
    conn.commit()
    return [] if row is None else _DEPLOYMENTS.validate_python(row[0])
