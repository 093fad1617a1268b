"""The shim's server (aiohttp, both sides): local auth, caps, pacing, forwarding with retries, the stream relay,
metering, and one ledger row per call."""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web
from multidict import CIMultiDict
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from contract import pricing
from contract.models import PROVIDER_OUTAGE
from shim.admission import Gate
from shim.breaker import Breaker
from shim.caps import ATTEMPT_CAP, LocalBudget, ValkeyBudget, micro
from shim.config import ShimConfig
from shim.hold import RunHold
from shim.ledger import Ledger
from shim.pacer import NoopPacer, PaceRequest, PastDeadline, ValkeyPacer, throttled_dimension
from shim.progress import SessionProgress
from shim.retry import Backoff, retry_after_s
from shim.wire import (
    CHAT,
    MESSAGES,
    ROUTES,
    SSESplitter,
    StreamMeter,
    Usage,
    dumps,
    error_body,
    loads,
    normalise,
    retryable_status,
    retryable_stream_error,
    sse_error,
    usage_from_body,
)

log = logging.getLogger("shim")

UPSTREAM_PATHS = {kind: path for path, kind in ROUTES.items()}
DEFAULT_MAX_OUTPUT = 16384
CLIENT_GONE = "client disconnected"
GATEWAY_CALL_ID = "x-litellm-call-id"  # each upstream attempt's name: the gateway's id of the call (its meter row)
REPLAY_OF = "x-evalplane-replay-of"  # a retry's earlier attempts, one of which the gateway may have answered
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "trailers", "transfer-encoding", "upgrade", "content-length", "host", "date", "server"})
_DROP_UP = _HOP | {"authorization", "x-api-key", "accept-encoding", "cookie", "content-encoding", "content-type",
                   "expect", GATEWAY_CALL_ID, REPLAY_OF}
NO_RETRY = {"x-should-retry": "false"}
_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


@dataclass
class Failure:
    """An upstream attempt that failed in a way worth retrying."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(slots=True)
class Call:
    kind: str
    route: str
    call_id: uuid.UUID = field(default_factory=uuid.uuid4)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    t0: float = field(default_factory=time.monotonic)
    stream: bool = False
    http_status: int = 0
    outcome: str = "ok"
    usage: Usage | None = None  # summed over the metered attempts
    raws: list = field(default_factory=list)  # raw usage of each metered attempt
    estimated: bool = False
    cost: float = 0.0
    retries: int = 0
    pacer_wait_ms: float = 0.0
    held_ms: float = 0.0  # held by the pool's open outage breaker or the run's call hold
    answered: bool = False  # the provider answered (the pool is up, as its breaker should learn)
    payload_bytes: int = 0
    max_out: int = 0
    hold_id: str | None = None  # the budget hold, settled once the call is over
    pace: PaceRequest | None = None  # the last attempt's pool booking, settled likewise ...
    used: Usage | None = None  # ... with what that attempt used
    out: web.StreamResponse | None = None  # a stream's answer, once its head went to the harness
    gateway_call_id: str | None = None  # the gateway's id for the last attempt that it answered
    cut: set[str] = field(default_factory=set)  # attempts whose answer was cut after its head (billed, unseen)
    meter: StreamMeter | None = None  # the stream attempt being relayed
    finished: bool = False  # its ledger row is written (once)


class Shim:
    def __init__(self, cfg: ShimConfig, upstream_key: str | None, redis=None):
        """`redis`: a shared redis.asyncio client (several shims in one process, as in tests); else its own."""
        self.cfg = cfg
        self._key = upstream_key or None
        self._token = cfg.local_token.encode()
        self.upstream = cfg.upstream_url.rstrip("/").removesuffix("/v1")
        self._shared_redis = redis
        self.redis = None
        self.backoff = Backoff(cfg.backoff_base_s, cfg.backoff_cap_s, cfg.max_retry_after_s)
        self.price = self._load_price()
        self.ledger = Ledger(cfg.ledger_path, cfg.ref, cfg.results_queue_url, cfg.batch_size, cfg.batch_interval_s)
        self.calls = self.turns = self.in_flight = self.retries = 0
        self._failing: set[int] = set()  # calls being retried after an upstream failure (429, 5xx, unreachable)
        self.stopped: str | None = None
        self.cache_share = 0.0  # cache-read share of the last metered prompt (Anthropic's ITPM estimate)
        self.last_call_at: float | None = None
        self.deadline: float | None = None  # the attempt's wall time, on time.monotonic() (moved on by holds)
        self.breaker: Breaker | None = None
        self.run_hold: RunHold | None = None
        self.held_s = 0.0  # the time calls were held (breaker or run hold): not the attempt's wall time
        self._holding: dict[uuid.UUID, float] = {}  # calls held now -> since (their time is in status' held_s)
        self.port: int | None = None
        self.ready = False
        self._published_at = 0.0
        self._bg: set[asyncio.Task] = set()
        self._calls: dict[asyncio.Task, Call] = {}  # the tasks handling model calls now, and their calls
        self._settling: list[Call] = []  # finished calls whose settles are on their way (_after)

    def _load_price(self) -> pricing.Price | None:
        try:
            return pricing.price_one(self.cfg.model, self.cfg.provider)
        except (pricing.UnknownModel, OSError, ValueError) as e:
            log.warning("no price for model %r (%s): calls are metered at cost 0 and the cost caps cannot bind",
                        self.cfg.model, type(e).__name__)
            return None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        cfg = self.cfg
        if cfg.limits.wall_time_s is not None:
            self.deadline = time.monotonic() + cfg.limits.wall_time_s
        self.redis = self._shared_redis
        if self.redis is None and cfg.valkey_url:
            self.redis = aioredis.Redis.from_url(
                cfg.valkey_connect_url, socket_timeout=5, socket_connect_timeout=5,
                retry=Retry(ExponentialBackoff(cap=1.0), 4), retry_on_error=[ConnectionError, TimeoutError])
        if self.redis is not None:
            budget = ValkeyBudget(self.redis, cfg.ref, cfg.limits.cost_usd, cfg.run_cost_usd, cfg.hold_ttl_s)
            self.pacer = ValkeyPacer(self.redis, cfg.pool, cfg.pacer_burst_s, cfg.pacer_max_wait_s,
                                     max_retry_after_s=cfg.max_retry_after_s)
        else:
            budget, self.pacer = LocalBudget(cfg.limits.cost_usd, cfg.run_cost_usd, cfg.hold_ttl_s), NoopPacer()
        if self.redis is not None and cfg.limits.outage_bound_s is not None:  # no bound: retries, then rate_limited
            self.breaker = Breaker(self.redis, cfg.pool, cfg.breaker_failures, cfg.breaker_window_s,
                                   cfg.breaker_probe_s, cfg.breaker_poll_s)
        if self.redis is not None:
            self.run_hold = RunHold(self.redis, cfg.ref.run, cfg.hold_poll_s)
        self.progress = SessionProgress(self.redis, cfg.ref, cfg.pool)
        self.gate = Gate(budget, self.pacer, self.progress, self.redis)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                          sock_read=cfg.sock_read_timeout_s))
        server = web.Server(self.handle, access_log=None)
        self.runner = web.ServerRunner(server, shutdown_timeout=cfg.shutdown_timeout_s)
        await self.runner.setup()
        await web.TCPSite(self.runner, cfg.listen_host, cfg.listen_port).start()
        self.port = self.runner.addresses[0][1]
        await self.progress.publish(self._progress_fields())
        self._heartbeat = asyncio.create_task(self._beat(), name="progress-heartbeat")
        self.ready = True
        if cfg.port_file:
            tmp = cfg.port_file.with_name(cfg.port_file.name + ".tmp")
            tmp.write_text(str(self.port))
            os.replace(tmp, cfg.port_file)
        log.info("shim ready on %s:%d -> %s (%s, model %s)", cfg.listen_host, self.port, self.upstream,
                 cfg.provider, cfg.model)
        # what start-up made lives as long as the process: out of the collector's way (a full collection over it
        # stalls every call in flight), and so is what the SQS client's warm-up makes
        gc.freeze()
        warming = self.ledger.start()  # after the port file: the harness starts while boto3 loads
        if warming is not None:
            warming.add_done_callback(lambda _: gc.freeze())
        return self.port

    async def stop(self) -> bool:
        """Stop serving (in-flight calls get shutdown_timeout_s, then are cancelled and still land their ledger
        row), flush the ledger, write the status file. False if ledger rows could not be sent."""
        self.ready = False
        await self.runner.cleanup()
        # aiohttp cancels the request, not its handler: a call still here (held, or upstream past the grace) is
        # cancelled now, so that it lands its ledger row before the ledger closes
        if calls := list(self._calls):
            for task in calls:
                task.cancel()
            await asyncio.wait(calls, timeout=self.cfg.shutdown_timeout_s)
        for call in list(self._calls.values()):  # stuck past its cancellation: its row all the same, once
            log.warning("call %s had not ended %g s after it was cancelled at shutdown: its ledger row is written"
                        " as it stands", call.call_id, self.cfg.shutdown_timeout_s)
            self._cut(call)
            self._finish(call)
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        while self.in_flight and time.monotonic() < deadline:  # the cancelled calls' bookkeeping
            await asyncio.sleep(0.01)
        self._heartbeat.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        sent_all = await self.ledger.close(self.cfg.sqs_flush_timeout_s, send=self.cfg.flush_on_exit)
        await self.progress.publish(self._progress_fields())
        await self.session.close()
        if self.redis is not None and self._shared_redis is None:
            await self.redis.aclose()
        if self.cfg.status_path:
            tmp = self.cfg.status_path.with_name(self.cfg.status_path.name + ".tmp")
            tmp.write_text(json.dumps(self.status()))
            os.replace(tmp, self.cfg.status_path)
        log.info("shim stopped: %d calls, %d ledger rows, %d sent", self.calls, self.ledger.rows, self.ledger.sent)
        return sent_all

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            if time.monotonic() - self._published_at >= self.cfg.heartbeat_s * 0.9:
                await self.progress.publish(self._progress_fields())
                self._published_at = time.monotonic()

    def status(self) -> dict[str, Any]:
        """in_flight 0 means every call that reached the harness has its ledger row and its settles."""
        return {"calls": self.calls, "ledger_rows": self.ledger.rows, "ledger_sent": self.ledger.sent,
                "stopped": self.stopped, "totals": self.ledger.totals.model_dump(), "turns": self.turns,
                "retries": self.retries, "in_flight": self.in_flight, "held_s": round(self._held_s(), 3),
                "failing": len(self._failing),
                # rows the results queue did not accept (yet): at exit, the task sends them with its result
                "unsent_seqs": list(self.ledger.pending_seqs)}

    def _held_s(self) -> float:
        """The time calls were held, those held now included (the task's wall-time guard reads it while they are)."""
        now = time.monotonic()
        return self.held_s + sum(now - t0 for t0 in self._holding.values())

    def _progress_fields(self) -> dict[str, Any]:
        t = self.ledger.totals
        return {"calls": t.calls, "turns": self.turns,
                "tokens": t.input_tokens + t.cached_tokens + t.cache_write_tokens + t.output_tokens,
                "cost_usd": f"{t.cost_usd:.9f}", "stopped": self.stopped or "", "heartbeat_at": f"{time.time():.3f}",
                "last_call_at": "" if self.last_call_at is None else f"{self.last_call_at:.3f}"}

    # ------------------------------------------------------------ requests

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """POST /v1/chat/completions, /v1/responses, /v1/messages (also without /v1); GET /_shim/health and
        /_shim/status; anything else is an unknown route (404, with a ledger row)."""
        path, method = request.path, request.method
        if method in ("GET", "HEAD") and path in ("/_shim/health", "/_shim/status"):
            if path == "/_shim/health":
                return web.json_response({"ok": self.ready}, status=200 if self.ready else 503)
            return web.json_response(self.status())
        kind = (ROUTES.get(path) or ROUTES.get("/v1" + path)) if method == "POST" else None
        call = Call(kind or (MESSAGES if "messages" in path else CHAT), path)
        self.calls += 1
        self.in_flight += 1
        task = asyncio.current_task()
        self._calls[task] = call
        try:
            if not self._authorized(request.headers):
                return self._error(call, 401, "authentication_error", "invalid local token", "unauthorized")
            if kind is None:
                return self._error(call, 404, "not_found_error", f"unknown route {method} {path}", "bad_request")
            return await self._proxy(request, call)
        except asyncio.CancelledError:  # shutdown: what went through is metered, and the row is written
            self._cut(call)
            raise
        except Exception:
            log.exception("internal error in call %s", call.call_id)
            if call.out is not None:
                call.outcome = "stream_error"
                raise
            return self._error(call, 500, "api_error", "shim internal error", "error")
        finally:
            self._calls.pop(task, None)
            self._finish(call)

    def _cut(self, call: Call) -> None:
        """A call ended by the shim's shutdown: what went through is metered. A stream whose final event the harness
        had was answered in full: only the read for the meter was cut."""
        if call.finished:
            return
        if (t0 := self._holding.get(call.call_id)) is not None:  # held still (a handler stuck in the hold loop)
            call.held_ms += (time.monotonic() - t0) * 1000
        complete = call.meter is not None and call.meter.done and call.meter.error is None
        call.outcome = "cancelled" if call.out is None else "ok" if complete else "stream_error"
        if call.out is not None:
            call.http_status = call.http_status or 200
        if call.meter is not None:
            self._stream_usage(call, call.meter, complete=complete)

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        token = headers.get("x-api-key") or ""
        if not token:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._token)

    def _error(self, call: Call, status: int, etype: str, message: str, outcome: str, code: str | None = None,
               headers: Mapping[str, str] = NO_RETRY) -> web.Response:
        """A local error for the harness, in the route's format."""
        call.http_status = call.http_status or status
        call.outcome = outcome
        return web.json_response(error_body(call.kind, etype, message, code), status=status, headers=headers)

    async def _end(self, call: Call, error: dict[str, Any]) -> web.StreamResponse:
        """End a stream whose head the harness has with an error event (the SDKs raise on it)."""
        await self._write_end(call.out, sse_error(call.kind, error))
        return call.out

    async def _write_end(self, out: web.StreamResponse, tail: bytes) -> None:
        try:
            await out.write_eof(tail)
        except ConnectionError:
            pass  # the harness went away; the row records what happened

    async def _read_body(self, request: web.BaseRequest) -> bytes | None:
        """The request body; None if it is larger than max_body_bytes."""
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return None
        chunks, size = [], 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _proxy(self, request: web.BaseRequest, call: Call) -> web.StreamResponse:
        try:
            raw = await self._read_body(request)
        except Exception as e:  # noqa: BLE001 - a body that could not be read or decoded (content-encoding)
            return self._error(call, 400, "invalid_request_error", f"unreadable request body: {type(e).__name__}",
                               "bad_request")
        if raw is None:
            return self._error(call, 413, "request_too_large",
                               f"request body exceeds {self.cfg.max_body_bytes} bytes", "bad_request")
        try:
            body = loads(raw)
        except ValueError:
            return self._error(call, 400, "invalid_request_error", "request body is not valid JSON", "bad_request")
        if not isinstance(body, dict):
            return self._error(call, 400, "invalid_request_error", "request body must be a JSON object",
                               "bad_request")
        call.stream = body.get("stream") is True
        if not isinstance(body.get("model"), str) or not body["model"]:
            return self._error(call, 400, "invalid_request_error", "missing required field: model", "bad_request")
        forwarded = self.cfg.upstream_model or self.cfg.model
        modified = body["model"] != forwarded
        body["model"] = forwarded  # pinned to one model (and priced as cfg.model)
        if call.kind == CHAT and call.stream:
            so = body.get("stream_options")
            if not (isinstance(so, dict) and so.get("include_usage")):
                body["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
                modified = True
        payload = dumps(body) if modified else raw
        call.payload_bytes = len(payload)

        # ---- the run's hold (`pause --hold-calls`), caps, then the pool: a held call is admitted once it goes on
        await self._hold(call, new=True)
        if self.stopped:
            return self._refuse(call, self.stopped)
        if self.cfg.limits.max_turns is not None and self.turns >= self.cfg.limits.max_turns:
            return self._refuse(call, "max_turns_exceeded")
        self.turns += 1
        max_out = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens")
        if not isinstance(max_out, int) or isinstance(max_out, bool) or max_out <= 0:
            max_out = min((self.price.max_output_tokens if self.price else None) or DEFAULT_MAX_OUTPUT,
                          DEFAULT_MAX_OUTPUT)
        call.max_out = max_out
        est, pace = self._estimate(len(payload), max_out)
        hold_id = str(call.call_id)
        try:
            which, waited = await self._hold_budget(hold_id, est, pace)
        except PastDeadline:
            call.hold_id = hold_id
            return await self._rate_limited(call, None, "the pool's wait would pass the attempt's wall time")
        except Exception as e:  # noqa: BLE001 - any store failure is answered the same way
            self.turns -= 1
            log.error("budget hold failed: %s", type(e).__name__)
            return self._error(call, 503, "api_error", "budget store unavailable", "error",
                               headers={"x-should-retry": "true", "retry-after": "2"})
        if which:
            self.turns -= 1
            scope = "attempt" if which == ATTEMPT_CAP else "run"
            return self._refuse(call, "budget_exceeded", f"the {scope} cost cap does not allow this call")
        call.hold_id = hold_id
        call.pacer_wait_ms += waited
        return await self._forward(request, call, payload, pace)

    def _refuse(self, call: Call, reason: str, detail: str | None = None) -> web.StreamResponse:
        """A call the session's state refuses; the first refusal ends the session."""
        if self.stopped is None:
            self.stopped = reason
            log.warning("stopping: %s", reason)
        if reason == PROVIDER_OUTAGE:
            return self._error(call, 400, "invalid_request_error",
                               "provider_outage: the provider's outage outlasted the run's bound; this attempt has ended",
                               reason, code=reason)
        if reason == "rate_limited":
            return self._error(call, 400, "invalid_request_error",
                               "rate_limited: the upstream stayed rate-limited or unavailable; this attempt has ended",
                               reason, code=reason)
        detail = detail or ("the attempt's turn limit is reached" if reason == "max_turns_exceeded"
                            else "the cost cap does not allow this call")
        return self._error(call, 403, reason, f"{reason}: {detail}", reason)

    async def _rate_limited(self, call: Call, last: Failure | None, why: str,
                            reason: str = "rate_limited") -> web.StreamResponse:
        """The upstream stays unavailable (retries exhausted, waiting would pass the attempt's wall time, or the
        pool's outage outlasted its bound: reason provider_outage): a non-retryable answer that ends the session
        (the task lands the attempt as an infrastructure failure)."""
        if last is not None:
            err = _error_of(last.body)
            detail = (err.get("message") or err.get("type")) if err else None
            why += f" (last: {last.status}{f' {detail}' if detail else ''})"
            call.http_status = last.status
        self.stopped = self.stopped or reason
        log.warning("stopping: %s: %s", reason, why)
        message = f"{reason}: {why}; this attempt has ended"
        call.outcome = reason
        if call.out is not None:
            return await self._end(call, {"type": "invalid_request_error", "code": reason, "message": message})
        return self._error(call, 400, "invalid_request_error", message, reason, code=reason)

    async def _hold(self, call: Call, new: bool = False) -> bool | None:
        """Hold the call while its gate is shut: for a new call (`new`: before its budget hold and pacing), the
        run's call hold (`pause --hold-calls`, shim/hold.py), until it is lifted; for a call about to go upstream,
        the pool's outage breaker, until it closes or the call is the pool's probe. The time held is the call's
        held_ms and moves the attempt's wall-time deadline on. True if it was held, False if not, None once the
        outage has lasted longer than limits.outage_bound_s (the attempt ends; a run hold has no bound)."""
        gate, bound = (self.run_hold, None) if new else (self.breaker, self.cfg.limits.outage_bound_s)
        what = "run's call hold" if new else "outage breaker"
        if gate is None:
            return False
        try:
            open_s = await gate.open_for_s()
        except Exception as e:  # noqa: BLE001 - a gate that cannot be read holds nothing
            log.warning("%s unreadable: %s", what, type(e).__name__)
            return False
        if open_s is None:
            return False
        t0 = self._holding[call.call_id] = time.monotonic()
        try:
            while open_s is not None:
                if bound is not None and open_s > bound:
                    return None
                if await gate.probe():
                    break
                await asyncio.sleep(max(gate.poll_s, 0.05))
                open_s = await gate.open_for_s(fresh=True)
        except Exception as e:  # noqa: BLE001 - a gate that cannot be read holds nothing
            log.warning("%s unreadable: %s", what, type(e).__name__)
        finally:
            del self._holding[call.call_id]
            held = time.monotonic() - t0
            call.held_ms += held * 1000
            self.held_s += held
            if self.deadline is not None:
                self.deadline += held
        return True

    async def _breaker_failed(self) -> None:
        try:
            if await self.breaker.failed() is not None:
                log.warning("pool %s: the provider is out (outage breaker open)", self.cfg.pool)
        except Exception as e:  # noqa: BLE001 - the retries go on without it
            log.warning("outage breaker update failed: %s", type(e).__name__)

    async def _breaker_ok(self) -> None:
        try:
            if await self.breaker.ok():
                log.warning("pool %s: the provider answers again (outage breaker closed)", self.cfg.pool)
        except Exception as e:  # noqa: BLE001 - the next success tells it
            log.warning("outage breaker update failed: %s", type(e).__name__)

    def _estimate(self, nbytes: int, max_out: int) -> tuple[int, PaceRequest]:
        """A call's worst-case cost (micro-dollars) for its budget hold, and what it books with the pool: the
        prompt as ~3 bytes a token for the hold (generous), ~4 for the pool (settled to the truth after).
        Anthropic counts only uncached input toward ITPM: estimated with the last call's cache-read share."""
        est_in = (nbytes + 2) // 3
        est = 0
        if self.price:
            rates = self.price.rates(est_in)  # the tier the prompt may reach, at worst
            est = micro(est_in * rates.input + max_out * rates.output)
        prompt = (nbytes + 3) // 4
        if self.cfg.provider == "anthropic":
            prompt = int(prompt * (1.0 - self.cache_share))
        return est, PaceRequest(self.cfg.pool, prompt, max_out)

    def _limit_input(self, usage: Usage) -> int:
        """Tokens of a call that count toward the pool's input limit, by the provider's rules."""
        if self.cfg.provider == "anthropic":
            return usage.input_tokens + usage.cache_write_tokens
        return usage.input_tokens + usage.cached_tokens + usage.cache_write_tokens

    def _upstream_headers(self, headers: Mapping[str, str], kind: str) -> CIMultiDict:
        h = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _DROP_UP)
        h["Accept-Encoding"] = "identity"
        h["Content-Type"] = "application/json"
        if self._key:
            if kind == MESSAGES:
                h["x-api-key"] = self._key
            else:
                h["Authorization"] = f"Bearer {self._key}"
        return h

    @staticmethod
    def _down_headers(headers: Mapping[str, str]) -> CIMultiDict:
        return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP)

    # ------------------------------------------------------------ upstream

    async def _hold_budget(self, hold_id: str, est: int, pace: PaceRequest) -> tuple[int, float]:
        """The call's budget hold and first admission (Gate.hold); a store that fails (Valkey restarting, a host
        under load) is asked again for up to store_wait_s before the call is refused: the hold is taken once per
        id, however often it is asked."""
        give_up, n = time.monotonic() + self.cfg.store_wait_s, 0
        while True:
            try:
                return await self.gate.hold(hold_id, est, pace, self.deadline)
            except PastDeadline:
                raise
            except Exception as e:  # any store failure is asked again the same way
                n += 1
                delay = self.backoff.delay(n)
                if time.monotonic() + delay > give_up:
                    raise
                log.warning("budget hold failed (%s), asking again in %.1f s", type(e).__name__, delay)
                await asyncio.sleep(delay)

    async def _forward(self, request: web.BaseRequest, call: Call, payload: bytes,
                       pace: PaceRequest) -> web.StreamResponse:
        try:
            return await self._forward_retrying(request, call, payload, pace)
        finally:
            self._failing.discard(id(call))

    async def _forward_retrying(self, request: web.BaseRequest, call: Call, payload: bytes,
                                pace: PaceRequest) -> web.StreamResponse:
        url = self.upstream + UPSTREAM_PATHS[call.kind]
        headers = self._upstream_headers(request.headers, call.kind)
        last: Failure | None = None
        attempt = 0
        sent: list[str] = []  # the call's upstream attempts by name: a retry names them, the gateway may replay one
        while True:
            if last is not None:  # the task's wall-time guard reads it: time spent so is the provider's, not the model's
                self._failing.add(id(call))
            if last is not None and last.status != 429 and self.breaker is not None:  # a 429 is the pacer's
                await self._breaker_failed()
            held = await self._hold(call)
            if held is None:
                call.pace = call.pace or pace
                return await self._rate_limited(call, last, "the pool's outage outlasted the run's bound",
                                                reason=PROVIDER_OUTAGE)
            attempt = 1 if held else attempt + 1  # a hold starts the call's retries again
            if attempt > self.cfg.max_attempts:
                if last.status == 429 or self.breaker is None or not self.breaker.may_trip():
                    break
                attempt = self.cfg.max_attempts  # an outage the breaker may yet see: retry at the backoff's cap
            if last is not None:
                if not held:
                    delay = self.backoff.delay(attempt - 1, last.headers)
                    if self.deadline is not None and time.monotonic() + delay > self.deadline:
                        return await self._rate_limited(call, last,
                                                        "the next retry would pass the attempt's wall time")
                    await asyncio.sleep(delay)
                call.retries += 1
                try:
                    call.pacer_wait_ms += await self.pacer.admit(pace, self.deadline)
                except PastDeadline:
                    return await self._rate_limited(call, last, "the pool's wait would pass the attempt's wall time")
            if sent:
                headers[REPLAY_OF] = ",".join(sent)
            sent.append(f"{call.call_id}:{len(sent) + 1}")
            headers[GATEWAY_CALL_ID] = sent[-1]
            try:
                resp = await self.session.post(url, data=payload, headers=headers)
            except _UPSTREAM_ERRORS as e:
                last = Failure(502, {}, self._err_json(call, f"upstream unreachable: {type(e).__name__}"))
                await self._pace_settle(pace, None)
                continue
            call.gateway_call_id = resp.headers.get(GATEWAY_CALL_ID) or call.gateway_call_id
            call.cut.discard(call.gateway_call_id or "")  # an attempt cut before, its kept answer replayed now
            try:
                if resp.status != 200:
                    try:
                        data = await resp.read()
                    except _UPSTREAM_ERRORS as e:
                        resp.close()
                        data = self._err_json(call, f"upstream failed: {type(e).__name__}")
                    if resp.status == 429:
                        await self._throttled(pace, resp.headers, data)
                    await self._pace_settle(pace, None)
                    self._discover(resp.headers, force=resp.status == 429)
                    if retryable_status(resp.status, data):
                        last = Failure(resp.status, resp.headers, data)
                        log.info("upstream %d (attempt %d), retrying", resp.status, attempt)
                        continue
                    return await self._pass(call, resp, data)
                self._discover(resp.headers)
                if call.stream and resp.content_type == "text/event-stream":
                    failed = await self._relay(request, call, resp, pace)
                    if failed is None:
                        call.answered = True
                        return call.out
                    last = failed
                    log.info("stream failed before content (attempt %d), retrying", attempt)
                    continue
                try:
                    data = await resp.read()
                except _UPSTREAM_ERRORS as e:  # the provider answered (and billed): estimated, unless replayed
                    resp.close()
                    call.cut.add(resp.headers.get(GATEWAY_CALL_ID) or sent[-1])
                    await self._pace_settle(pace, self._usage_guess(call, call.max_out))
                    last = Failure(502, {}, self._err_json(call, f"upstream failed: {type(e).__name__}"))
                    continue
                call.http_status = 200
                if call.out is not None:  # not a stream after all, on a retry of one whose head went out
                    out = call.out
                    await self._write_end(out, data)
                else:
                    out = web.Response(status=200, body=data, headers=self._down_headers(resp.headers))
                    try:  # the harness has its answer before the metering, the row and the settles
                        await out.prepare(request)
                        await out.write_eof()
                    except ConnectionError:
                        pass  # the harness went away; the call happened and is recorded as answered
                call.pace, call.used = pace, self._account(call, usage_from_body(call.kind, data), estimated=False)
                call.answered = True
                return out
            finally:
                resp.release()
        assert last is not None
        return await self._rate_limited(call, last, f"upstream still failing after {self.cfg.max_attempts} attempts")

    async def _pass(self, call: Call, resp: aiohttp.ClientResponse, data: bytes) -> web.StreamResponse:
        """A terminal upstream error, to the harness as it came, marked final."""
        call.http_status = resp.status
        call.outcome = "error"
        call.answered = resp.status < 500
        log.warning("upstream %d passed on as final: %s", resp.status, data[:300].decode(errors="replace"))
        if call.out is not None:  # a retried stream: its head is out, the error ends it
            return await self._end(call, _error_of(data) or {"type": "api_error",
                                                            "message": data.decode(errors="replace")[:500]})
        headers = self._down_headers(resp.headers)
        headers.popall("x-should-retry", None)
        headers.update(NO_RETRY)
        headers.setdefault("Content-Type", "application/json")
        return web.Response(status=resp.status, body=data, headers=headers)

    async def _relay(self, request: web.BaseRequest, call: Call, resp: aiohttp.ClientResponse,
                     pace: PaceRequest) -> Failure | None:
        """Relay a stream: its head goes to the harness at once (its time to first byte is the provider's); its
        events are held back until the first content event, so that a failure before it is retried without
        the harness seeing any of it (a retried attempt's events follow the same head), then passed on as they
        arrive, upstream reading waiting on the harness's. Metered; a Failure if it failed before content."""
        if call.out is None:
            call.out = web.StreamResponse(status=200, headers=self._down_headers(resp.headers))
            try:
                await call.out.prepare(request)
            except ConnectionError:
                pass  # the first write finds the harness gone
        out, meter, split = call.out, StreamMeter(call.kind), SSESplitter()
        call.meter = meter
        held: list[bytes] = []
        held_bytes, committed, ended, failure = 0, False, False, None
        while True:
            try:
                chunk = await resp.content.readany()
            except _UPSTREAM_ERRORS as e:
                failure = f"upstream stream failed: {type(e).__name__}"
                break
            if not chunk:
                break
            for event in split.feed(chunk):
                meter.on_event(*event)
            if ended:
                continue  # after the final event: read for the meter only
            if not committed:
                held.append(chunk)
                held_bytes += len(chunk)
                if meter.error_before_content and retryable_stream_error(meter.error or {}):
                    call.meter = None
                    await self._pace_settle(pace, self._stream_usage(call, meter, complete=False))
                    return Failure(529, {}, json.dumps(meter.error).encode())
                if not (meter.error_before_content or meter.meaningful or meter.done
                        or held_bytes > self.cfg.max_stream_buffer_bytes):
                    continue
                committed, chunk, held = True, b"".join(held), []
            try:
                if meter.done or meter.error is not None:
                    ended = True  # the answer ends here; nothing after the final or error event is relayed
                    await out.write_eof(chunk)
                else:
                    await out.write(chunk)
            except ConnectionError:
                if not ended:
                    failure = CLIENT_GONE
                    resp.close()  # the provider stops sending
                    break
        call.meter = None
        if not committed:  # broke or ended before any content: retried, but what may have been billed is metered
            await self._pace_settle(pace, self._stream_usage(call, meter, complete=False))
            return Failure(502, {}, self._err_json(call, failure or "upstream stream ended before any content"))
        call.http_status = 200
        if failure is None and meter.error is None and not meter.done:
            failure = "upstream stream ended early"
        complete = failure is None and meter.error is None
        call.outcome = "ok" if complete else "stream_error"
        call.pace, call.used = pace, self._stream_usage(call, meter, complete=complete)
        if failure is not None:
            log.warning("stream cut: %s", failure)
        elif meter.error is not None:
            log.warning("stream ended by an error event: %s", json.dumps(meter.error)[:300])
        if not ended:  # tell the harness the stream broke (the SDKs raise on an in-stream error)
            tail = b"" if failure == CLIENT_GONE else sse_error(call.kind, {"type": "api_error", "message": failure})
            await self._write_end(out, tail)
        return None

    # ------------------------------------------------------------ metering

    @staticmethod
    def _usage_guess(call: Call, est_output: int, raw: dict[str, Any] | None = None) -> Usage:
        """An attempt's usage where the provider's count is missing or partial: the request's size, the output seen."""
        usage = normalise(call.kind, raw)
        if raw is None or not (usage.input_tokens or usage.cached_tokens or usage.cache_write_tokens):
            usage.input_tokens = (call.payload_bytes + 3) // 4
        usage.output_tokens = max(usage.output_tokens, est_output)
        return usage

    def _account(self, call: Call, raw: dict[str, Any] | None, estimated: bool, est_output: int = 0) -> Usage:
        """Meter one upstream attempt into the call's row (a call's retries may each have been billed)."""
        estimated = raw is None or estimated
        usage = self._usage_guess(call, est_output, raw) if estimated else normalise(call.kind, raw)
        call.raws.append(raw)
        call.usage = usage if call.usage is None else call.usage + usage
        call.estimated = call.estimated or estimated
        call.cost = round(call.cost + (self.price.cost(usage) if self.price else 0.0), 9)
        prompt = usage.input_tokens + usage.cached_tokens + usage.cache_write_tokens
        if not estimated and prompt:
            self.cache_share = usage.cached_tokens / prompt
        return usage

    def _stream_usage(self, call: Call, meter: StreamMeter, complete: bool) -> Usage | None:
        """Meter a stream attempt: its usage events, else an estimate if the provider may have billed it.
        An error event before any usage or content is taken as not billed (nothing is recorded)."""
        if meter.saw_usage:
            return self._account(call, meter.raw, estimated=not complete, est_output=meter.delta_tokens)
        if meter.error is not None and not meter.meaningful and not meter.delta_tokens:
            return None
        return self._account(call, None, estimated=True, est_output=meter.delta_tokens)

    async def _pace_settle(self, pace: PaceRequest, used: Usage | None) -> None:
        """Settle a failed attempt's pool booking: what it used, or (unknown) no output and the input kept."""
        try:
            if used is None:
                await self.pacer.settle(pace, None, 0)
            else:
                await self.pacer.settle(pace, self._limit_input(used), used.output_tokens)
        except Exception as e:  # noqa: BLE001 - a booking not refunded decays by itself
            log.warning("pacer settle failed: %s", type(e).__name__)

    async def _throttled(self, pace: PaceRequest, headers: Mapping[str, str], body: bytes) -> None:
        try:
            await self.pacer.throttled(pace, retry_after_s(headers), throttled_dimension(headers, body))
        except Exception as e:  # noqa: BLE001 - the retry goes on; the pool learns from the next 429
            log.warning("pacer throttle update failed: %s", type(e).__name__)

    def _discover(self, headers: Mapping[str, str], force: bool = False) -> None:
        """Record the pool's rate-limit headers (at most once a minute, or on a 429), off the call's path."""
        found = self.progress.discovered(headers, force)
        if found:
            self.in_flight += 1  # part of the call's bookkeeping
            self._spawn(self._record(found))

    async def _record(self, found: dict[str, str]) -> None:
        try:
            await self.progress.record(found)
        finally:
            self.in_flight -= 1

    def _err_json(self, call: Call, message: str) -> bytes:
        return dumps(error_body(call.kind, "api_error", message))

    # ------------------------------------------------------------ after the call

    def _finish(self, call: Call) -> None:
        """The call's ledger row, written before anything else can run; then, in the background, its settles
        and the progress hash (in_flight covers them). Once per call."""
        if call.finished:
            return
        call.finished = True
        now = time.monotonic()
        self.last_call_at = time.time()
        self.retries += call.retries
        for _ in call.cut:  # attempts cut after their head and never replayed: billed, estimated at max output
            self._account(call, None, True, est_output=call.max_out)
            call.raws.insert(0, call.raws.pop())  # before the answered attempt, whose usage stays last
        call.cut.clear()
        u = call.usage or Usage()
        # the last attempt's usage verbatim; earlier billed attempts (retried after a cut) listed beside it
        raw = call.raws[-1] if len(call.raws) == 1 else (
            {**(call.raws[-1] or {}), "evalplane_prior_attempts": call.raws[:-1]} if call.raws else None)
        self.ledger.append(
            call_id=call.call_id, pool=self.cfg.pool, provider=self.cfg.provider, model=self.cfg.model,
            route=call.route, stream=call.stream, started_at=call.started_at, input_tokens=u.input_tokens,
            cached_tokens=u.cached_tokens, cache_write_tokens=u.cache_write_tokens, output_tokens=u.output_tokens,
            cost_usd=call.cost, latency_ms=round((now - call.t0) * 1000, 3),
            pacer_wait_ms=round(call.pacer_wait_ms, 3), retries=call.retries, http_status=call.http_status,
            outcome=call.outcome, usage_estimated=call.estimated, raw_usage=raw, gateway_call_id=call.gateway_call_id,
            held_ms=round(call.held_ms, 3))
        if call.answered and self.breaker is not None and self.breaker.should_report_ok():
            self._spawn(self._breaker_ok())
        self._settling.append(call)
        if len(self._settling) == 1:  # the calls finished in this turn of the event loop settle together
            self._spawn(self._after())

    async def _after(self) -> None:
        calls, self._settling = self._settling, []
        try:
            settles = []
            for call in calls:
                used_in = used_out = None
                if call.pace is not None:
                    used_in, used_out = (None, 0) if call.used is None else (
                        self._limit_input(call.used), call.used.output_tokens)
                settles.append((call.hold_id, micro(call.cost) if call.hold_id else 0, call.pace, used_in, used_out))
            await self.gate.after(settles, self._progress_fields())
            self._published_at = time.monotonic()
        except Exception as e:  # noqa: BLE001 - holds and bookings expire by themselves; the ledger is the record
            log.error("settle/progress after call failed: %s", type(e).__name__)
        finally:
            self.in_flight -= len(calls)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)


def _error_of(body: bytes) -> dict[str, Any] | None:
    """The error object of an upstream error body, if it has one."""
    try:
        doc = loads(body)
    except ValueError:
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    return err if isinstance(err, dict) else None
