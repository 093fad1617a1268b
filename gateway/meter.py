"""The gateway's LiteLLM callback (litellm_settings.callbacks = gateway.meter.meter): before a call, the key's
scope and the alias's deployments; after it, one meter row (gateway/runtime.py: Valkey, then PostgreSQL)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger

from gateway import replay
from gateway.config import GatewaySettings
from gateway.runtime import Runtime, tokens

ROW_WAIT_S = 2.0  # the longest an answer waits for its meter row to be safe in Valkey
_FORGET_S = 60.0


class GatewayMeter(CustomLogger):
    """An answer goes out only once its row is in Valkey (async_post_call_success_hook waits for the logger, which
    LiteLLM runs as a task beside it), so a replica killed after answering has not lost the call's row. A stream's
    row is written when it ends, after its last event went out."""

    def __init__(self):
        super().__init__()
        self._runtime: Runtime | None = None
        self._written: dict[str, tuple[float, asyncio.Event]] = {}  # call id -> (since, set once its row is in)

    def _written_event(self, call_id: str) -> asyncio.Event:
        now = time.monotonic()
        if call_id not in self._written:
            for old in [k for k, (t, _) in self._written.items() if now - t > _FORGET_S]:
                del self._written[old]
            self._written[call_id] = (now, asyncio.Event())
        return self._written[call_id][1]

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:  # made in the proxy's event loop, on first use
            self._runtime = Runtime(GatewaySettings.from_env())
        return self._runtime

    async def async_pre_call_hook(self, user_api_key_dict, cache, data, call_type):
        alias = data.get("model")
        scope = (user_api_key_dict.metadata or {}).get("aliases") or []
        if alias not in scope:
            raise HTTPException(status_code=403, detail={"error": f"gateway: this key may not call {alias!r}"})
        from litellm.proxy.proxy_server import llm_router

        if not await self.runtime.ensure_alias(llm_router, alias):
            raise HTTPException(status_code=404, detail={"error": f"gateway: no alias {alias!r}"})
        return data

    async def _row(self, kwargs, status: str) -> None:
        slo = kwargs.get("standard_logging_object") or {}
        meta = slo.get("metadata") or {}
        owner = meta.get("user_api_key_user_id")
        if not owner:  # not a call under a run's key (the master key's health checks)
            return
        cost = float(slo.get("response_cost") or 0.0) if status == "ok" else 0.0
        row = {"gateway_call_id": slo.get("litellm_call_id") or slo.get("id"), "owner": owner,
               "alias": slo.get("model_group") or "", "deployment": slo.get("model_id") or "",
               "route": slo.get("call_type") or "",
               "started_at": datetime.fromtimestamp(slo.get("startTime") or 0, UTC).isoformat(),
               **tokens(meta.get("usage_object") if status == "ok" else None), "cost_usd": cost,
               "latency_ms": ((slo.get("endTime") or 0) - (slo.get("startTime") or 0)) * 1000, "status": status,
               "replica": self.runtime.settings.replica}
        await self.runtime.record(row, cost, owner)
        self._written_event(row["gateway_call_id"]).set()

    async def async_post_call_success_hook(self, data, user_api_key_dict, response):
        call_id = data.get("litellm_call_id")
        if call_id:
            try:
                await asyncio.wait_for(self._written_event(call_id).wait(), ROW_WAIT_S)
            except TimeoutError:
                pass  # the logger is late: the answer goes anyway (the row follows, unless the replica dies now)
            self._written.pop(call_id, None)
        return response

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        await self._row(kwargs, "ok")

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        await self._row(kwargs, "error")


meter = GatewayMeter()


def _install_replay() -> None:
    from litellm.proxy.proxy_server import app

    replay.install(app, lambda: meter.runtime.valkey, lambda: meter.runtime.settings.answer_ttl_s)


_install_replay()
