"""Live progress in Valkey (contract.keys.progress, TTL'd: doubles as the task's heartbeat) and the
rate-limit headers seen per pool (contract.keys.pool_discovered)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from contract import keys
from contract.models import AttemptRef

log = logging.getLogger("shim.progress")

_RATE_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-", "anthropic-priority-")
DISCOVERY_EVERY_S = 60.0


def rate_limit_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Provider rate-limit headers, with LiteLLM's llm_provider- prefix stripped."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        low = name.lower()
        if low.startswith("llm_provider-"):
            low = low[len("llm_provider-"):]
            if low in out:
                continue  # an unprefixed copy wins
        if low.startswith(_RATE_PREFIXES):
            out[low] = value
    return out


class Progress:
    def __init__(self, redis, ref: AttemptRef, pool: str):
        self.redis = redis
        self.key = keys.progress(ref)
        self.discovered_key = keys.pool_discovered(pool)
        self._last_discovery = 0.0
        self._warned = False

    async def publish(self, fields: Mapping[str, object]) -> None:
        if self.redis is None:
            return
        mapping = {k: ("" if v is None else str(v)) for k, v in fields.items()}
        try:
            async with self.redis.pipeline(transaction=True) as p:  # hash and TTL together
                p.hset(self.key, mapping=mapping)
                p.expire(self.key, keys.PROGRESS_TTL_S)
                await p.execute()
            self._warned = False
        except Exception as e:  # progress is best effort; the ledger is the record
            if not self._warned:
                log.warning("progress update failed: %s", type(e).__name__)
                self._warned = True

    def queue(self, pipe, fields: Mapping[str, object]) -> None:
        """Add the progress update to a pipeline the caller executes (one round trip with the settles)."""
        pipe.hset(self.key, mapping={k: ("" if v is None else str(v)) for k, v in fields.items()})
        pipe.expire(self.key, keys.PROGRESS_TTL_S)

    async def discover(self, headers: Mapping[str, str], force: bool = False) -> None:
        if self.redis is None:
            return
        now = time.monotonic()
        if not force and now - self._last_discovery < DISCOVERY_EVERY_S:
            return
        found = rate_limit_headers(headers)
        if not found:
            return
        self._last_discovery = now
        found["seen_at"] = f"{time.time():.3f}"
        try:
            await self.redis.hset(self.discovered_key, mapping=found)
        except Exception as e:
            log.warning("limit discovery write failed: %s", type(e).__name__)
