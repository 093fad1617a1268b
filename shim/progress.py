"""Live progress in Valkey (contract.keys.progress, TTL'd: doubles as the task's heartbeat) and the
rate-limit headers seen per pool (contract.keys.pool_discovered)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from contract import keys

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


class SessionProgress:
    """One attempt's live progress hash (what its shim has metered so far) and its pool's discovered limits; not
    the dispatcher's run-wide view (dispatcher.driver.progress.Progress)."""

    def __init__(self, redis, ref, pool: str):
        self.redis = redis
        self.key = keys.progress(ref)
        self.discovered_key = keys.pool_discovered(pool)
        self._last_discovery = 0.0
        self._warned = False

    async def publish(self, fields: Mapping[str, Any]) -> None:
        if self.redis is None:
            return
        try:
            async with self.redis.pipeline(transaction=True) as pipe:  # the hash and its TTL together
                mapping = {k: "" if v is None else v for k, v in fields.items()}
                await pipe.hset(self.key, mapping=mapping).expire(self.key, keys.PROGRESS_TTL_S).execute()
            self._warned = False
        except Exception as e:  # noqa: BLE001 - progress is best effort; the ledger is the record
            if not self._warned:
                log.warning("progress update failed: %s", type(e).__name__)
                self._warned = True

    def discovered(self, source, force: bool = False) -> dict[str, str] | None:
        """The rate-limit headers to record now (at most once a minute, or on a 429), or None. `source`: the
        headers, or what has them as `.headers` (read only when due)."""
        if self.redis is None:
            return None
        now = time.monotonic()
        if not force and now - self._last_discovery < DISCOVERY_EVERY_S:
            return None
        self._last_discovery = now  # also when there are none: a gateway that sends none is not asked every call
        found = rate_limit_headers(source if isinstance(source, Mapping) else source.headers)
        if not found:
            return None
        found["seen_at"] = f"{time.time():.3f}"
        return found

    async def record(self, found: Mapping[str, str]) -> None:
        try:
            await self.redis.hset(self.discovered_key, mapping=dict(found))
        except Exception as e:  # noqa: BLE001 - discovery is best effort
            log.warning("limit discovery write failed: %s", type(e).__name__)
