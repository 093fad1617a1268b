"""What a gateway replica holds while it serves: its Valkey and PostgreSQL connections, the keys it checks, the
aliases it has loaded into LiteLLM's router, and the meter rows on their way to PostgreSQL.

Rows go to a Valkey list first (one RPUSH after the answer, off the hot path) and from there to PostgreSQL in
batches, by whichever replica holds the drain lock: a replica killed between the two loses none, since the list
outlives it and the next drain takes its rows (the INSERT ignores a row already landed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time

import psycopg
import redis.asyncio as aioredis
from psycopg.conninfo import conninfo_to_dict
from redis.exceptions import LockNotOwnedError

from contract import keys as vkeys
from gateway import aliases, keyfile
from gateway import keys as gkeys
from gateway.config import GatewaySettings

log = logging.getLogger("gateway")

ROW_FIELDS = ("gateway_call_id", "owner", "alias", "deployment", "route", "started_at", "input_tokens",
              "cached_tokens", "cache_write_tokens", "output_tokens", "cost_usd", "latency_ms", "status", "replica")
# A replica SIGKILLed while draining leaves its lock behind: a short lease lets the next drain start soon, and the
# trim happens only while the lease is still this drain's (one that outlived it leaves the rows for the next drain).
DRAIN_LEASE_S = 5
_TRIM_IF_OWNED = ("if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('ltrim', KEYS[2], ARGV[2], -1) return 1"
                  " end return 0")
_INSERT = (f"INSERT INTO gateway_calls ({', '.join(ROW_FIELDS)}) VALUES ({', '.join(['%s'] * len(ROW_FIELDS))})"
           " ON CONFLICT (gateway_call_id) DO NOTHING")


def tokens(usage: dict | None) -> dict[str, int]:
    """Tokens by kind from LiteLLM's (OpenAI-shaped) usage: prompt_tokens counts cached reads and cache writes."""
    u = usage or {}
    details = u.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or u.get("cache_read_input_tokens") or 0)
    written = int(u.get("cache_creation_input_tokens") or details.get("cache_creation_tokens") or 0)
    prompt = int(u.get("prompt_tokens") or 0)
    return {"input_tokens": max(prompt - cached - written, 0), "cached_tokens": cached,
            "cache_write_tokens": written, "output_tokens": int(u.get("completion_tokens") or 0)}


def meter_keys(host: str, port: int | str | None, dbname: str) -> tuple[str, str]:
    """The Valkey list of meter rows on their way to one database, and its drain lock: named by the database's
    place, not its URL, so replicas logged in as their own role and the dispatcher name the same list."""
    database = hashlib.sha256(f"{host}:{int(port or 5432)}/{dbname}".encode()).hexdigest()[:16]
    return vkeys.gateway_rows(database), vkeys.gateway_drain_lock(database)


def database_place(database_url: str) -> tuple[str, int | str | None, str]:
    d = conninfo_to_dict(database_url)
    return d.get("host") or "", d.get("port"), d.get("dbname") or ""


class Runtime:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.valkey = aioredis.Redis.from_url(settings.valkey_url)
        self._db: psycopg.AsyncConnection | None = None
        self._db_lock = asyncio.Lock()
        self._loaded: dict[str, float] = {}  # alias -> when its deployments were last read
        self._drainer: asyncio.Task | None = None
        self.rows_key, self.lock_key = meter_keys(*database_place(settings.database_url))
        self._trim_if_owned = self.valkey.register_script(_TRIM_IF_OWNED)

    async def _query(self, fn):
        """fn(conn) on the replica's one PostgreSQL connection (made again after a failure)."""
        async with self._db_lock:
            if self._db is None or self._db.closed:
                self._db = await psycopg.AsyncConnection.connect(self.settings.database_url, autocommit=True)
            try:
                return await fn(self._db)
            except psycopg.OperationalError:
                await self._db.close()
                raise

    # ------------------------------------------------------------------ keys
    async def key(self, api_key: str) -> gkeys.KeyRecord | None:
        """The live key's record, or None (unknown, revoked, expired)."""
        h = gkeys.key_hash(api_key)
        rec = gkeys.from_cache(await self.valkey.get(vkeys.gateway_key(h)))
        if rec is None:
            async def find(conn):
                return await (await conn.execute(gkeys.LIVE_KEY_SQL, (h,))).fetchone()
            rec = gkeys.record_of(await self._query(find))
            if rec is None:
                return None
            await self.valkey.set(vkeys.gateway_key(h), rec.model_dump_json(),
                                  pxat=int(rec.expires_at.timestamp() * 1000))
        return None if rec.expired() else rec

    async def spent_usd(self, owner: str) -> float:
        return int(await self.valkey.get(vkeys.gateway_spend(owner)) or 0) / 1e6

    # ------------------------------------------------------------------ aliases
    async def ensure_alias(self, router, alias: str) -> bool:
        """The alias's deployments in the router (read again every alias_refresh_s); False if it has none."""
        if time.monotonic() - self._loaded.get(alias, -1e9) < self.settings.alias_refresh_s:
            return True

        async def find(conn):
            cur = await conn.execute("SELECT deployments FROM gateway_aliases WHERE alias = %s", (alias,))
            return await cur.fetchone()
        row = await self._query(find)
        if row is None:
            return False
        from litellm.types.router import Deployment, LiteLLM_Params, ModelInfo

        wanted = [aliases.Deployment.model_validate(x) for x in row[0]]
        store = keyfile.store(self.settings)  # a file here, Secrets Manager on an estate: calls that may block
        provider_keys = await asyncio.to_thread(lambda: {d.key_name: store.get(d.key_name) for d in wanted})
        for d in wanted:
            router.upsert_deployment(Deployment(
                model_name=alias, model_info=ModelInfo(id=d.id),
                litellm_params=LiteLLM_Params(model=d.model, api_base=d.api_base,
                                              api_key=provider_keys[d.key_name] or "")))
        for gone in {x["model_info"]["id"] for x in router.get_all_deployments(model_name=alias)} - {d.id for d in wanted}:
            router.delete_deployment(gone)  # the alias was registered again without it (a run resumed elsewhere)
        self._loaded[alias] = time.monotonic()
        return True

    # ------------------------------------------------------------------ the meter
    async def record(self, row: dict, cost_usd: float, owner: str) -> None:
        async with self.valkey.pipeline(transaction=False) as p:
            p.rpush(self.rows_key, json.dumps(row, default=str))
            if cost_usd:
                p.incrby(vkeys.gateway_spend(owner), round(cost_usd * 1e6))
            await p.execute()
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain_forever())

    async def _drain_forever(self) -> None:
        while True:
            try:
                if not await self.drain():
                    await asyncio.sleep(self.settings.drain_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # PostgreSQL or Valkey away: the rows wait in Valkey
                log.exception("gateway meter: drain failed; rows stay in Valkey")
                await asyncio.sleep(self.settings.drain_interval_s)

    async def drain(self) -> int:
        """Move up to drain_batch rows from Valkey to PostgreSQL (one replica at a time); how many moved."""
        lock = self.valkey.lock(self.lock_key, timeout=DRAIN_LEASE_S, blocking=False)
        if not await lock.acquire():
            return 0
        try:
            raw = await self.valkey.lrange(self.rows_key, 0, self.settings.drain_batch - 1)
            if not raw:
                return 0
            rows = [json.loads(r) for r in raw]

            async def insert(conn):
                async with conn.cursor() as cur:
                    await cur.executemany(_INSERT, [tuple(r[f] for f in ROW_FIELDS) for r in rows])
            await self._query(insert)
            if not await self._trim_if_owned(keys=[self.lock_key, self.rows_key], args=[lock.local.token, len(raw)]):
                return 0  # the lease ran out mid-way: the rows stay for the next drain (the INSERT ignores repeats)
            return len(raw)
        finally:
            with contextlib.suppress(LockNotOwnedError):
                await lock.release()
