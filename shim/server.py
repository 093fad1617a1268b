"""The shim's server: auth swap, caps, forwarding with retries, SSE relay, metering (HTTP: shim/http.py)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from contract import pricing
from shim.caps import ATTEMPT_CAP, Budget, LocalBudget, ValkeyBudget, micro
from shim.config import ShimConfig
from shim.front import DataPlane
from shim.gate import Demand, Gate, Ticket
from shim.http import (
    Headers,
    Request,
    Responder,
    Response,
    Server,
    Upstream,
    UpstreamError,
    line_filter,
)
from shim.kv import KV, as_kv
from shim.ledger import Ledger
from shim.pacer import NoopPacer, Pacer, PaceRequest, ValkeyPacer, throttled_dimension
from shim.progress import DISCOVERY_EVERY_S, Progress
from shim.retry import Backoff, retry_after_s
from shim.stream import CLIENT_GONE, StreamRelay
from shim.wire import (
    CHAT,
    MESSAGES,
    StreamMeter,
    Usage,
    dumps,
    error_body,
    loads,
    normalise,
    retryable_status,
    usage_from_body,
)

log = logging.getLogger("shim")


ROUTES = {CHAT: "/v1/chat/completions", MESSAGES: "/v1/messages"}
DEFAULT_MAX_OUTPUT = 16384
_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
        "transfer-encoding", "upgrade", "content-length", "host", "date", "server",
    }
)
# content-encoding passes through with the bytes downstream (we ask for identity anyway);
# content-encoding upstream: shim/http.py has already decoded the harness's body, and we send it as read
_DROP_UP = _HOP | {"authorization", "x-api-key", "accept-encoding", "cookie", "content-encoding", "expect",
                   "x-evalplane-resume"}  # the last: from the compiled data plane
NO_RETRY = (("x-should-retry", "false"),)
_JSON = ("Content-Type", "application/json")
_UPSTREAM_ERRORS = (UpstreamError, TimeoutError, OSError)


# an upstream answer's header block (shim/http.py) as the harness gets it: hop-by-hop lines dropped
_down_block = line_filter(_HOP)


def _rates_grow(price: pricing.Price) -> bool:
    """Whether each pricing tier's input and output rates are at least those of the tier below it."""
    rates = [price.base, *(r for _, r in price.tiers)]
    return all(b.input >= a.input and b.output >= a.output for a, b in zip(rates, rates[1:]))


@dataclass
class _Retry:
    """An attempt that failed in a way worth retrying; the last one is passed through if all fail."""

    status: int
    headers: Mapping[str, str]  # shim.http.Headers (case-insensitive) when it came from upstream
    body: bytes
    content_type: str = "application/json"


class _Ids:
    """Random (version 4) UUIDs as strings, 256 from one os.urandom read, formatted in one pass (a syscall per
    call is measurable on an idle, cold CPU, and so was formatting each through uuid.UUID.__str__)."""

    def __init__(self) -> None:
        self._pool: list[str] = []

    def __call__(self) -> str:
        if not self._pool:
            raw = bytearray(os.urandom(16 * 256))
            raw[6::16] = bytes(b & 0x0F | 0x40 for b in raw[6::16])  # the version, 4
            raw[8::16] = bytes(b & 0x3F | 0x80 for b in raw[8::16])  # the variant, RFC 4122
            h = raw.hex()
            self._pool = [f"{h[i:i + 8]}-{h[i + 8:i + 12]}-{h[i + 12:i + 16]}-{h[i + 16:i + 20]}-{h[i + 20:i + 32]}"
                          for i in range(0, len(h), 32)]
        return self._pool.pop()


_new_id = _Ids()
_NO_USAGE = Usage()


@dataclass(slots=True)
class Call:
    kind: str
    route: str
    call_id: str = field(default_factory=_new_id)  # a UUID
    started_at: float = field(default_factory=time.time)  # epoch seconds (formatted for the ledger row)
    t0: float = field(default_factory=time.monotonic)
    stream: bool = False
    http_status: int = 0
    outcome: str = "ok"
    usage: Usage | None = None  # None until metered
    raw_usage: dict[str, Any] | None = None
    estimated: bool = False
    cost: float = 0.0
    retries: int = 0
    pacer_wait_ms: float = 0.0
    payload_bytes: int = 0
    max_out: int = 0
    raws: tuple[dict[str, Any] | None, ...] = ()  # raw usage of each metered attempt
    hold_id: str | None = None  # a budget hold to settle once the call is over
    final_pace: tuple[PaceRequest, Usage | None] | None = None  # the last attempt's pacer settle, likewise
    resp: Responder | None = None  # how this call answers the harness
    answered: bool = False  # a non-stream 200 already handed to the harness (answer_now)
    ended: float = 0.0  # monotonic: the handler was done (the ledger row's latency ends here)

    def answer(self, block: bytes, body: bytes) -> None:
        """`block`: the upstream answer's header block (Response.block)."""
        self.answered = True
        try:
            self.resp.send(200, _down_block(block), body)
        except ConnectionError:
            pass  # the harness went away; the call happened and is recorded as answered

    def begin_now(self, conn) -> None:
        """Upstream.post_head's on_head for a stream: a 200's head goes to the harness at once (its events wait
        for the first content event, shim/stream.py); a retried attempt's does not (the harness has one)."""
        if conn.status == 200 and not self.resp.started:
            try:
                self.resp.begin(200, _down_block(conn.block))
            except ConnectionError:
                pass  # the relay finds the harness gone at its first write

    def answer_now(self, conn) -> None:
        """Upstream.post_head's on_complete: a 200 goes to the harness at once (anything else is the handler's
        to decide: retry or pass through)."""
        if conn.status == 200:
            self.answer(conn.block, conn.whole_body())


class Shim:
    def __init__(self, cfg: ShimConfig, upstream_key: str | None, pacer: Pacer | None = None, redis=None):
        """`redis`: a shared redis.asyncio client (several shims in one process, as in tests); else own one."""
        self.cfg = cfg
        self._key = upstream_key or None
        self._local_token = cfg.local_token.encode()
        self._head_key = object()  # this shim's upstream request head, cached on the harness's parsed headers
        self._auth_key = object()  # whether those headers carry the local token, likewise
        self.upstream = cfg.upstream_url.rstrip("/")
        self.upstream = self.upstream.removesuffix("/v1")
        self.pacer: Pacer = pacer or NoopPacer()
        self._own_pacer = pacer is None
        self._shared_redis = redis
        self.cache_share = 0.0  # cache-read share of the last metered prompt (Anthropic ITPM estimate)
        self.backoff = Backoff(cfg.backoff_base_s, cfg.backoff_cap_s, cfg.max_retry_after_s)
        self.price = self._load_price()
        # a ticket covers a call no larger than the one it was sized for, without pricing it (Gate.hold): so
        # long as a larger prompt never has lower rates (no pricing tier is cheaper than the one below it)
        self._sized = self.price is None or _rates_grow(self.price)
        self.ledger = Ledger(
            cfg.ledger_path, cfg.ref, cfg.results_queue_url, cfg.batch_size, cfg.batch_interval_s
        )
        self.calls = 0
        self.turns = 0
        self.in_flight = 0
        self.retries = 0
        self.stopped: str | None = None
        self.last_call_at: float | None = None
        self.port: int | None = None
        self.redis = None  # a shim.kv.KV (or a redis-py client wrapped as one)
        self.gate: Gate | None = None
        self.budget: Budget | None = None
        self.progress: Progress | None = None
        self.http: Upstream | None = None
        self.server: Server | None = None
        self._routes = {path: kind for kind, path in ROUTES.items()}
        self._routes.update({path[3:]: kind for kind, path in ROUTES.items()})  # base URL without /v1
        self._bg: set[asyncio.Task] = set()
        self._heartbeat: asyncio.Task | None = None
        self._published_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._unfinished: list[Call] = []  # calls whose bookkeeping waits (_finish_soon)
        self._finish_timer: asyncio.TimerHandle | None = None
        self.ready = False
        # the compiled data plane (shim/front.py), when it serves the harness: tickets lent to it (by hold id)
        self.dataplane: DataPlane | None = None
        self._lent: dict[str, Ticket] = {}
        self._recalling: dict[str, Ticket] = {}  # lent tickets past their time, asked back
        self._dp_in_flight = 0  # the data plane's calls in flight, as of its last `end`
        self._dp_demand = Demand()  # how many of its calls the tickets should cover
        self.dataplane_calls = self.dataplane_asks = 0
        self._after_calls: list[Call] = []  # finished, their bookkeeping to come (_after_batch)
        self._asking = 0  # tickets being made for the data plane's asks (Shim._ask)
        self._recalls_sent = self._recalls_done = 0
        self._recall_waiters: list[tuple[int, asyncio.Future]] = []  # (recall number, done when answered)
        self._discover_asked = 0.0

    # ------------------------------------------------------------ lifecycle

    def _load_price(self) -> pricing.Price | None:
        try:
            return pricing.price_one(self.cfg.model, self.cfg.provider)
        except (pricing.UnknownModel, OSError, ValueError) as e:
            log.warning("no price for model %r (%s): calls are metered at cost 0 and the cost caps "
                        "cannot bind", self.cfg.model, type(e).__name__)
            return None

    async def dispatch(self, request: Request, resp: Responder) -> None:
        """Routes: POST /v1/chat/completions, /v1/messages (and without /v1); GET /_shim/health, /_shim/status;
        anything else is an unknown route (404, with a ledger row). With the compiled data plane, requests come
        from it: a call it hands over after a failed attempt (`x-evalplane-resume`), or one it did not take."""
        if self.dataplane is not None and "x-evalplane-resume" in request.headers:
            await self.resume(request, resp)
            return
        if request.method == "POST":
            kind = self._routes.get(request.path)
            if kind is not None:
                await self.proxy(request, resp, kind)
                return
        elif request.method in ("GET", "HEAD"):
            if request.path == "/_shim/health":
                self._json(resp, {"ok": self.ready}, 200 if self.ready else 503)
                return
            if request.path == "/_shim/status":
                self._json(resp, await self.status_now(), 200)
                return
        await self.unknown(request, resp)

    @staticmethod
    def _json(resp: Responder, doc: Any, status: int, headers: tuple = ()) -> None:
        try:
            resp.send(status, (_JSON, *headers), json.dumps(doc).encode())
        except ConnectionError:
            pass  # the client went away; a call still gets its ledger row

    async def start(self) -> int:
        cfg = self.cfg
        self._loop = asyncio.get_running_loop()
        if self._shared_redis is not None:
            self.redis = as_kv(self._shared_redis)
        elif cfg.valkey_url:
            # one pipelined connection (shim/kv.py); connects on first use
            self.redis = KV(cfg.valkey_url, socket_timeout_s=5, connect_timeout_s=5, retries=4)
        if self.redis is not None:
            self.budget = ValkeyBudget(self.redis, cfg.ref, cfg.limits.cost_usd, cfg.run_cost_usd, cfg.hold_ttl_s)
            if self._own_pacer:
                self.pacer = ValkeyPacer(self.redis, cfg.pool, cfg.pacer_burst_s, cfg.pacer_max_wait_s,
                                         max_retry_after_s=cfg.max_retry_after_s)
        else:
            self.budget = LocalBudget(cfg.limits.cost_usd, cfg.run_cost_usd, cfg.hold_ttl_s)
        self.gate = Gate(self.budget, self.pacer, cfg.ticket_ttl_s, cfg.ticket_room)
        self.progress = Progress(self.redis, cfg.ref, cfg.pool)
        self.http = Upstream(self.upstream, cfg.connect_timeout_s, cfg.sock_read_timeout_s)
        self.ledger.start()
        self.server = Server(self.dispatch, cfg.max_body_bytes)
        compiled = cfg.dataplane == "compiled"
        if compiled and (why := DataPlane.usable(cfg.upstream_url)):
            log.warning("dataplane: compiled was asked for, but %s: the Python shim serves the harness", why)
            compiled = False
        if compiled:
            inner = await self.server.start("127.0.0.1", 0)  # the data plane's way in, for what it hands over
            self.dataplane = DataPlane(self._on_dataplane)
            self.port = await self.dataplane.start(cfg, inner, self._key, self._default_max_out())
        else:
            self.port = await self.server.start(cfg.listen_host, cfg.listen_port)
        await self.progress.publish(self._progress_fields())
        self._heartbeat = asyncio.create_task(self._beat(), name="progress-heartbeat")
        self.ready = True
        if cfg.port_file:
            tmp = cfg.port_file.with_name(cfg.port_file.name + ".tmp")
            tmp.write_text(str(self.port))
            os.replace(tmp, cfg.port_file)
        log.info("shim ready on %s:%d -> %s (%s, model %s, %s data plane)", cfg.listen_host, self.port,
                 self.upstream, cfg.provider, cfg.model, "compiled" if self.dataplane else "python")
        self.ledger.warm()  # after the port file: the harness can start while boto3 loads
        return self.port

    async def stop(self) -> bool:
        """Stop serving (in-flight calls get shutdown_timeout_s), flush the ledger, write status."""
        self.ready = False
        if self.dataplane is not None:  # it finishes its calls in flight, then exits
            await self.dataplane.stop(self.cfg.shutdown_timeout_s)
        if self.server is not None:
            await self.server.shutdown(self.cfg.shutdown_timeout_s)
        self._finish_pending()
        # cancelled handlers still write their ledger row (and settle their hold): let them finish
        deadline = time.monotonic() + 5
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        await self._give_back(everything=True)
        sent_all = await self.ledger.close(self.cfg.sqs_flush_timeout_s, send=self.cfg.flush_on_exit)
        if self.progress is not None:
            await self.progress.publish(self._progress_fields())
        if self.http is not None:
            self.http.close()
        if self.redis is not None and self._shared_redis is None:
            await self.redis.aclose()
        self.write_status()
        log.info("shim stopped: %d calls, %d ledger rows, %d sent", self.calls, self.ledger.rows, self.ledger.sent)
        return sent_all

    def write_status(self) -> None:
        if self.cfg.status_path:
            tmp = self.cfg.status_path.with_name(self.cfg.status_path.name + ".tmp")
            tmp.write_text(json.dumps(self.status()))
            os.replace(tmp, self.cfg.status_path)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(min(self.cfg.heartbeat_s, self.cfg.ticket_ttl_s or self.cfg.heartbeat_s))
            await self._give_back()
            if time.time() - (self._published_at or 0.0) >= self.cfg.heartbeat_s * 0.9:
                await self.progress.publish(self._progress_fields())
                self._published_at = time.time()

    async def _give_back(self, everything: bool = False) -> None:
        """Give back tickets that were not used in time (at shutdown, all of them)."""
        cmds = self.gate.expired_cmds(everything) if self.gate is not None else []
        cmds += self._recall_expired(everything)
        if cmds:
            await self._run_cmds(cmds, "giving a ticket back")

    # ------------------------------------------------------------ status

    async def status_now(self) -> dict[str, Any]:
        """status(), with the compiled data plane's calls in flight counted: in_flight 0 means every call that
        reached the harness has its ledger row (the data plane's `end` lines wait in its Outbox)."""
        dp_in_flight = await self.dataplane.sync() if self.dataplane is not None else None
        doc = self.status()
        if dp_in_flight is not None:
            doc["in_flight"] += dp_in_flight
        elif self.dataplane is not None and self.dataplane.alive:
            doc["in_flight"] += 1  # no answer in time: not known to be idle
        doc["dataplane_in_flight"] = dp_in_flight
        return doc

    def status(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "ledger_rows": self.ledger.rows,
            "ledger_sent": self.ledger.sent,
            "stopped": self.stopped,
            "totals": self.ledger.totals.model_dump(),
            "turns": self.turns,
            "retries": self.retries,
            "in_flight": self.in_flight,
            # rows a results queue did not accept (yet): at exit, the task sends them with its result
            "unsent_seqs": list(self.ledger.pending_seqs),
            # calls that went on a ticket (no Valkey round trip), tickets taken and given back (shim/gate.py)
            "tickets": dict(self.gate.stats) if self.gate is not None else {},
            "dataplane": "compiled" if self.dataplane is not None else "python",
            "dataplane_calls": self.dataplane_calls,  # the calls the compiled data plane served (an end line)
            "dataplane_asks": self.dataplane_asks,  # the tickets it asked for (no lent one covered a call)
            "tickets_lent": len(self._lent),
        }

    def _progress_fields(self) -> dict[str, Any]:
        t = self.ledger.totals
        return {
            "calls": t.calls,
            "turns": self.turns,
            "tokens": t.input_tokens + t.cached_tokens + t.cache_write_tokens + t.output_tokens,
            "cost_usd": f"{t.cost_usd:.9f}",
            "last_call_at": "" if self.last_call_at is None else f"{self.last_call_at:.3f}",
            "stopped": self.stopped or "",
            "heartbeat_at": f"{time.time():.3f}",
        }

    # ------------------------------------------------------------ entry points

    def _authorized(self, request: Request) -> bool:
        derived = request.headers.derived  # a harness sends the same headers call after call: checked once
        ok = derived.get(self._auth_key)
        if ok is None:
            token = request.headers.get("x-api-key")
            if not token:
                auth = request.headers.get("authorization", "")
                token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            ok = derived[self._auth_key] = hmac.compare_digest(token.encode(), self._local_token)
        return ok

    async def unknown(self, request: Request, resp: Responder) -> None:
        kind = MESSAGES if "messages" in request.path else CHAT
        call = self._begin(kind, request.path)
        call.resp = resp
        try:
            if not self._authorized(request):
                return self._local_error(call, 401, "authentication_error", "invalid local token", "unauthorized")
            return self._local_error(
                call, 404, "not_found_error", f"unknown route {request.method} {request.path}", "bad_request"
            )
        finally:
            self._finish_soon(call)

    async def proxy(self, request: Request, resp: Responder, kind: str) -> None:
        call = self._begin(kind, request.path)
        call.resp = resp
        await self._guarded(call, self._handle(request, call))

    async def _guarded(self, call: Call, handling) -> None:
        """Await a call's handling (a coroutine): an internal error answers 500 if nothing went to the harness
        yet; either way the call gets its bookkeeping and ledger row (_finish_soon)."""
        try:
            return await handling
        except asyncio.CancelledError:
            call.outcome = "cancelled" if call.http_status == 0 else "stream_error"
            raise
        except Exception:
            log.exception("internal error in call %s", call.call_id)
            if call.http_status:
                call.outcome = "stream_error"
                raise
            return self._local_error(call, 500, "api_error", "shim internal error", "error")
        finally:
            self._finish_soon(call)

    def _begin(self, kind: str, route: str) -> Call:
        if self._unfinished:  # an earlier call's bookkeeping first: its settles go before this call's hold
            self._finish_pending()
        self.calls += 1
        self.in_flight += 1
        return Call(kind=kind, route=route)

    def _finish_soon(self, call: Call) -> None:
        """The call's bookkeeping (_finish), now or, for a lone call, `finish_delay_s` after its answer's end.
        Why: the answer has just woken the harness, and the shim's bookkeeping (~0.1-0.2 ms of CPU on a cold
        cache) ran just when the harness wanted the CPU; measured at c=1, the stream's last byte came 0.1-0.3
        ms later for it. Only a lone call waits: while calls overlap (in_flight > 1) the next one's ticket
        comes from this bookkeeping. A call that starts before it ran runs it first (_begin), a shutdown too."""
        call.ended = time.monotonic()
        delay = self.cfg.finish_delay_s
        if delay <= 0 or self.in_flight + self._dp_in_flight > 1 or self._loop is None:
            if self._unfinished:
                self._finish_pending()
            self._finish(call)
            return
        self._unfinished.append(call)
        if self._finish_timer is None:
            self._finish_timer = self._loop.call_later(delay, self._finish_pending)

    def _finish_pending(self) -> None:
        if self._finish_timer is not None:
            self._finish_timer.cancel()
            self._finish_timer = None
        calls, self._unfinished = self._unfinished, []
        for call in calls:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        """The call's ledger row (written and flushed before anything else can run), then its settles and
        progress in the background. A successful response has already been handed to the client here."""
        self.last_call_at = call.started_at + (call.ended - call.t0)
        self.retries += call.retries
        u = call.usage or _NO_USAGE
        ref = self.cfg.ref
        # contract.models.CallRecord's fields and JSON shape
        row = self.ledger.append({
            "call_id": call.call_id, "run": ref.run, "instance_id": ref.instance_id, "attempt": ref.attempt,
            "seq": 0, "pool": self.cfg.pool, "provider": self.cfg.provider, "model": self.cfg.model,
            "route": call.route, "stream": call.stream,
            "started_at": datetime.fromtimestamp(call.started_at, UTC).isoformat().replace("+00:00", "Z"),
            "input_tokens": u.input_tokens, "cached_tokens": u.cached_tokens,
            "cache_write_tokens": u.cache_write_tokens, "output_tokens": u.output_tokens, "cost_usd": call.cost,
            "latency_ms": round((call.ended - call.t0) * 1000, 3),
            "pacer_wait_ms": round(call.pacer_wait_ms, 3), "retries": call.retries,
            "http_status": call.http_status, "outcome": call.outcome, "usage_estimated": call.estimated,
            "raw_usage": call.raw_usage,
        })
        if log.isEnabledFor(logging.DEBUG):  # the ledger row is the call's record; this line only when asked
            log.debug("call %d %s %s -> %d %s in=%d cached=%d write=%d out=%d $%.6f retries=%d %.0fms",
                     row["seq"], call.route, "stream" if call.stream else "", call.http_status, call.outcome,
                     u.input_tokens, u.cached_tokens, u.cache_write_tokens, u.output_tokens, call.cost,
                     call.retries, row["latency_ms"])
        # settles and progress go to Valkey in one round trip, after the response (in_flight covers it), with
        # those of the other calls finished in this turn of the event loop
        self._after_calls.append(call)
        if len(self._after_calls) == 1:
            self._spawn(self._after_batch())

    def _spawn(self, coro) -> None:
        loop = self._loop
        if loop is None:  # kept: get_running_loop() is a getpid(2) on Python 3.11
            loop = self._loop = asyncio.get_running_loop()
        task = loop.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _after_batch(self) -> None:
        """The bookkeeping of the calls finished in one turn of the event loop (with the compiled data plane, the
        `end` lines of one read; else mostly one call), in one task: settle each call's last pacer booking and
        budget hold, publish progress (once, as of all of them) and take the next calls' tickets. With Valkey and
        a combined gate: one AFTER script per call (Gate.after_cmd), all in one round trip (an EVALSHA answered
        NOSCRIPT after a failover is run again with EVAL by the client). Why together: per call, a task, a
        pipeline and the progress fields cost the shim ~30% of its CPU per call with the compiled data plane."""
        calls, self._after_calls = self._after_calls, []
        fields = self._progress_fields()
        gate = self.gate
        if gate is not None and gate.combined and gate.kv is self.redis:
            return await self._after_combined(calls, fields, gate)
        for call in calls:
            await self._after(call, fields)

    async def _after(self, call: Call, fields: dict[str, Any]) -> None:
        """_after_batch for one call, without a combined gate (local caps, or an injected pacer)."""
        try:
            cmds: list[tuple] = []
            if call.final_pace is not None:
                pace, a_in, a_out = self._pool_actuals(call)
                if self.redis is not None and isinstance(self.pacer, ValkeyPacer) and self.pacer.kv is self.redis:
                    cmd = self.pacer.settle_cmd(pace, a_in, a_out)
                    if cmd:
                        cmds.append(cmd)
                else:
                    await self.pacer.settle(pace, a_in, a_out)
            if call.hold_id is not None:
                amount = micro(call.cost)
                if isinstance(self.budget, ValkeyBudget) and self.budget.kv is self.redis:
                    cmds.append(self.budget.settle_cmd(call.hold_id, amount))
                else:
                    await self.budget.settle(call.hold_id, amount)
            if self.redis is not None:  # (no tickets here: they need the combined gate)
                cmds += self.progress.cmds(fields)
                self._published_at = time.time()
                for res in await self.redis.pipeline(cmds, defer=True):
                    if isinstance(res, Exception):
                        log.error("settle/progress after call failed: %s", res)
        except Exception as e:  # noqa: BLE001 - holds and bookings expire by themselves; the ledger is the record
            log.error("settle/progress after call failed: %s", type(e).__name__)
        finally:
            self.in_flight -= 1

    def _pool_actuals(self, call: Call) -> tuple[PaceRequest, int | None, int]:
        """The last attempt's booking and what it used toward the pool's input and output limits (no usage: input
        unknown, so not refunded; output 0)."""
        pace, used = call.final_pace
        if used is None:
            return pace, None, 0
        return pace, self._limit_input(used), used.output_tokens

    async def _after_combined(self, calls: list[Call], fields: dict[str, Any], gate: Gate) -> None:
        """_after_batch with a combined gate: expired tickets given back, then one AFTER script per call (the
        progress with the last)."""
        pending: list = []  # each call's tickets asked for
        try:
            cmds = gate.expired_cmds()  # tickets past their time, given back before new ones are taken
            cmds += self._recall_expired()
            n = len(cmds)
            taking = self.stopped is None and self.ready
            no_progress = self.progress.update({})
            for k, call in enumerate(calls):
                pool = None if call.final_pace is None else ValkeyPacer.settle_args(*self._pool_actuals(call))
                # lent tickets not in a call yet: each of the data plane's calls in flight holds one of self._lent;
                # the calls before this one here are done
                spare = max(0, len(self._lent) - self._dp_in_flight)
                in_flight = self._dp_demand.calls(self.in_flight - k + self._dp_in_flight)
                wanted = (gate.tickets_wanted(in_flight, spare)
                          if call.hold_id is not None and taking else 0)
                tickets, targs = [], []
                if wanted:
                    # the next prompt is this one and a turn longer: its hold is sized for half as much again and
                    # 16 KiB more; its pool booking is this call's estimate (the settle reconciles it)
                    size = (call.payload_bytes * 3 // 2 + 16384, call.max_out)
                    est, _ = self._estimate(*size)
                    pace = self._pace_request(call.payload_bytes, call.max_out)
                    for i in range(wanted):
                        args, ticket = gate.ticket_args(f"t{i or ''}-{call.call_id}", est, pace,
                                                        size if self._sized else None)
                        targs.append(args)
                        tickets.append(ticket)
                pending.append(tickets)
                progress = self.progress.update(fields) if k == len(calls) - 1 else no_progress
                cmds.append(gate.after_cmd(call.hold_id, micro(call.cost) if call.hold_id is not None else 0, pool,
                                           progress, targs))
            self._published_at = time.time()
            # not urgent: waits a few ms to share a write with other calls' (a caller that calls again at once
            # takes a ticket taken ahead, Gate.tickets_wanted)
            replies = await self.redis.pipeline(cmds, defer=True)
            for res in replies[:n]:
                if isinstance(res, Exception):
                    log.error("giving an expired ticket back failed: %s", res)
            for tickets, last in zip(pending, replies[n:], strict=True):
                if isinstance(last, Exception):
                    log.error("settle/progress after call failed: %s", last)
                    for ticket in tickets:
                        gate.ticket_taken(ticket, last)
                    continue
                for ticket, reply in zip(tickets, last, strict=True):
                    gate.ticket_taken(ticket, reply)
        except BaseException as e:
            for tickets in pending:  # none left waiting (Gate.hold waits for them): not taken
                for ticket in tickets:
                    gate.ticket_taken(ticket, e)  # (a no-op for one already answered)
            if not isinstance(e, Exception):
                raise
            # holds and bookings expire by themselves; the ledger is the record
            log.error("settle/progress after call failed: %s", type(e).__name__)
        finally:
            self.in_flight -= len(calls)
        if self.dataplane is not None:
            self._lend()

    # ------------------------------------------------------------ the compiled data plane (shim/front.py)

    def _default_max_out(self) -> int:
        return min((self.price.max_output_tokens if self.price else None) or DEFAULT_MAX_OUTPUT, DEFAULT_MAX_OUTPUT)

    def _lend(self) -> None:
        """Lend the data plane the tickets that are in (booked, sized, not about to expire), while the turn cap
        leaves room for the calls they would carry."""
        dp, gate = self.dataplane, self.gate
        if dp is None or not dp.alive or self.stopped is not None or not self.ready:
            return
        max_turns = self.cfg.limits.max_turns
        now = time.monotonic()
        while gate.tickets and gate.tickets[0].done():
            t: Ticket | None = gate.tickets[0].result()
            if t is None:
                gate.tickets.popleft()
                continue
            if not t.booked or t.size is None or now >= t.expires_at - 2:
                return  # for a call that comes here (shim/gate.py asks for itself, as before)
            if max_turns is not None and self._turns_spoken_for() >= max_turns:
                return
            gate.tickets.popleft()
            self._lent[t.hold_id] = t
            dp.send(self._ticket_msg(t, _new_id(), now))

    @staticmethod
    def _ticket_msg(t: Ticket, call_id: str, now: float, **more: Any) -> dict[str, Any]:
        return {"t": "ticket", "id": t.hold_id, "call": call_id, "bytes": t.size[0], "max_out": t.size[1],
                "wait_ms": max(0.0, (t.start_at - now) * 1000), "ttl_ms": (t.expires_at - now) * 1000, **more}

    async def _ask(self, msg: dict[str, Any]) -> None:
        """The data plane has a call that no lent ticket covers (`back`: one it took that does not): a ticket
        made for it, with the round trip this shim's own path would make (Gate.hold: the budget hold and the
        pool booking, giving `back` back in the same round trip), or `no` (the call then comes here as it came:
        a cap refuses it, or the shim is stopping)."""
        answer: dict[str, Any] = {"t": "no", "for": msg["id"]}
        self.dataplane_asks += 1
        self._dp_demand.asked()
        try:
            back = msg.get("back")
            if back:
                self._take_back(back)
            if self._unfinished:  # earlier calls' settles first (and the tickets they take: Gate.hold waits for one)
                self._finish_pending()
            if self.stopped is not None or not self.ready or not self.gate.combined or not await self._turn_left():
                return
            nbytes, max_out = int(msg["bytes"]), int(msg["max_out"])
            need = self._estimate(nbytes, max_out)  # (the ticket's too, so priced here once)
            call_id = _new_id()
            self._asking += 1  # a turn spoken for while the round trip is out
            try:
                which, ok, wait_ms, _, hold_id, pace = await self.gate.hold(call_id, lambda: need, (nbytes, max_out))
            finally:
                self._asking -= 1
            if which:
                return
            waited = 0.0
            if not ok:  # too far ahead to book: waits here until it is booked (ValkeyPacer.admitted)
                waited, wait_ms = await self.pacer.admitted(pace, ok, wait_ms), 0.0
            now = time.monotonic()
            t = Ticket(hold_id, need[0], pace, (nbytes, max_out), True,
                       now + wait_ms / 1000, now + self.gate.ticket_ttl_s, asked=True)
            self._lent[hold_id] = t
            answer = self._ticket_msg(t, call_id, now, waited_ms=waited, **{"for": msg["id"]})
        except Exception as e:  # noqa: BLE001 - the call then comes here, where the same failure is answered
            log.warning("a ticket for the data plane failed: %s", type(e).__name__)
        finally:
            if self.dataplane is not None:
                self.dataplane.send(answer)

    def _turns_spoken_for(self) -> int:
        """The turns taken and those the data plane may take without asking: a call on each lent ticket (also one
        being recalled, until the data plane says it did not use it) and on each ticket being made for an ask.
        The turn cap holds against their sum, so calls on both sides never add up to more than max_turns."""
        return self.turns + len(self._lent) + len(self._recalling) + self._asking

    async def _turn_left(self) -> bool:
        """Whether the turn cap leaves a turn for one more call. When only tickets lent to the data plane stand
        in the way, they are asked back first: those it has not used come back (a call on one may be on its
        way there, or the harness may make no other call), and those in a call count."""
        max_turns = self.cfg.limits.max_turns
        if max_turns is None or self._turns_spoken_for() < max_turns:
            return True
        dp = self.dataplane
        if self.turns + self._asking >= max_turns or not self._lent or dp is None or not dp.alive:
            return False
        fut = self._loop.create_future()
        self._recall_waiters.append((self._recall(list(self._lent)), fut))
        try:
            await asyncio.wait_for(fut, 10)
        except TimeoutError:
            return False
        return self._turns_spoken_for() < max_turns

    def _recall_expired(self, everything: bool = False) -> list[tuple]:
        """Lent tickets past their time: asked back from the data plane (it stops using one a second early), and
        given back to Valkey once it says it has not used them (`recalled`). With the data plane gone, or at
        shutdown after it exited (`everything`), all of them at once: their commands."""
        if everything:
            self._lent.update(self._recalling)
            self._recalling = {}
        if not self._lent:
            return []
        now = time.monotonic()
        gone = [k for k, t in self._lent.items() if everything or now >= t.expires_at]
        if not gone:
            return []
        dp = self.dataplane
        if dp is not None and dp.alive and not everything:
            self._recall(gone)
            return []
        cmds: list[tuple] = []
        for k in gone:
            cmds += self.gate.give_back_cmds(self._lent.pop(k))
        return cmds

    def _recall(self, ids: list[str]) -> int:
        """Ask the data plane for these lent tickets back (it answers `recalled`, in order): the recall's number."""
        for k in ids:
            self._recalling[k] = self._lent.pop(k)
        self.dataplane.send({"t": "recall", "ids": ids})
        self._recalls_sent += 1
        return self._recalls_sent

    def _recalled(self, ids: list[str]) -> None:
        """The data plane's answer to a recall (one per recall, in order): the tickets it had not used."""
        cmds: list[tuple] = []
        for k in ids:
            t = self._recalling.pop(k, None)
            if t is not None:
                cmds += self.gate.give_back_cmds(t)
        if cmds:
            self._spawn(self._run_cmds(cmds, "giving a ticket back"))
        self._recalls_done += 1
        while self._recall_waiters and self._recall_waiters[0][0] <= self._recalls_done:
            _, fut = self._recall_waiters.pop(0)
            if not fut.done():
                fut.set_result(None)

    async def _run_cmds(self, cmds: list[tuple], what: str) -> None:
        try:
            for res in await self.redis.pipeline(cmds):
                if isinstance(res, Exception):
                    log.warning("%s failed: %s", what, res)
        except Exception as e:  # noqa: BLE001 - holds expire, bookings decay
            log.warning("%s failed: %s", what, type(e).__name__)

    def _take_back(self, hold_id: str) -> None:
        """A lent ticket the data plane did not use: the next call's here to use or give back (Gate.hold)."""
        t = self._lent.pop(hold_id, None) or self._recalling.pop(hold_id, None)
        if t is not None:
            fut = self._loop.create_future()
            fut.set_result(t)
            self.gate.tickets.appendleft(fut)

    def _on_dataplane(self, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "end":
            self._fast_end(msg)
        elif kind == "ask":
            self._spawn(self._ask(msg))
        elif kind == "recalled":
            self._recalled(msg["ids"])
        elif kind == "lost":
            if self.ready:
                log.error("the compiled data plane exited: the harness cannot reach the shim")
                self.ready = False
            self._lent.update(self._recalling)
            self._recalling = {}
            for _, fut in self._recall_waiters:  # no answer will come
                if not fut.done():
                    fut.set_result(None)
            self._recall_waiters = []

    def _fast_call(self, c: dict[str, Any]) -> tuple[Call, PaceRequest]:
        """A call the data plane made on a lent ticket, as this shim's own: counted, its turn taken, its hold and
        pool booking the ticket's (lent tickets never outnumber the turns left: _lend)."""
        t = self._lent.pop(c["ticket"], None) or self._recalling.pop(c["ticket"], None)
        call = self._begin(MESSAGES if c["kind"] == "messages" else CHAT, c["route"])
        call.call_id = c["call"]
        call.started_at = c["started_at"]
        call.stream = c["stream"]
        call.payload_bytes = c["bytes"]
        call.max_out = c["max_out"]
        self.turns += 1
        if t is None:  # given back already (it should not be: the data plane stops using one early)
            log.error("call %s went on a ticket no longer held", call.call_id)
            return call, self._pace_request(call.payload_bytes, call.max_out)
        if not t.asked:  # (an asked one's ticket, if any, was counted by Gate.hold)
            self.gate.stats["used"] += 1
        call.hold_id = t.hold_id
        return call, t.pace

    def _fast_end(self, msg: dict[str, Any]) -> None:
        """A call the data plane answered: metered from what it read, then the usual bookkeeping (_finish)."""
        call, pace = self._fast_call(msg["call"])
        self.dataplane_calls += 1
        self._dp_in_flight = msg["in_flight"]
        now = time.monotonic()
        self._dp_demand.ended(self._dp_in_flight, now)
        call.pacer_wait_ms += msg["pacer_wait_ms"]
        limits = msg.get("limits")
        if limits:
            found = self.progress.discovered(Headers([tuple(kv) for kv in limits]), force=True)
            if found:
                self._spawn(self.progress.record(found))
        if now - self._discover_asked >= DISCOVERY_EVERY_S:
            self._discover_asked = now
            self.dataplane.send({"t": "discover"})
        meter = msg.get("meter")
        if msg.get("cancelled"):  # cut at shutdown before its answer was committed (as _guarded's cancelled)
            used = None if meter is None else self._stream_usage(call, self._meter(call.kind, meter), complete=False)
            call.outcome = "cancelled"
        elif meter is None:
            call.http_status = 200
            call.answered = True
            raw = msg.get("usage")
            try:
                raw = loads(raw) if raw else None
            except ValueError:
                raw = None
            used = self._account(call, raw if isinstance(raw, dict) else None, estimated=False)
        else:
            call.http_status = 200
            meter = self._meter(call.kind, meter)
            cut = msg.get("failure") if msg.get("outcome") == "cut" else None
            if cut is None and meter.error is None and not meter.done:
                cut = "upstream stream ended early"
            complete = cut is None and meter.error is None
            used = self._stream_usage(call, meter, complete=complete)
            call.outcome = "ok" if complete else "stream_error"
            if cut is not None:
                log.warning("stream cut: %s", cut)
        call.final_pace = (pace, used)
        call.t0 = time.monotonic() - msg["latency_ms"] / 1000
        self._finish_soon(call)

    @staticmethod
    def _meter(kind: str, m: dict[str, Any]) -> StreamMeter:
        """A stream's meter from what the data plane read of it (shim/dataplane/src/sse.rs: StreamMeter's rules)."""
        meter = StreamMeter(kind)
        if m["usage"] is not None:
            meter.raw = m["usage"]
            meter.saw_usage = True
        if m["error"] is not None:
            try:
                doc = loads(m["error"])
            except ValueError:
                doc = None
            meter.error = doc if isinstance(doc, dict) and doc else {"error": {"type": "unknown"}}
        meter.meaningful = m["meaningful"]
        meter.done = m["done"]
        meter.delta_tokens = m["delta_tokens"]
        meter.error_before_content = m["error_before_content"]
        return meter

    async def resume(self, request: Request, resp: Responder) -> None:
        """A call the data plane made and handed over after its attempt failed: that attempt's bookkeeping as
        _forward would have done it, then the retries from here (the request body is the payload it sent)."""
        info = None
        try:
            info = json.loads(request.headers["x-evalplane-resume"])
            ok = hmac.compare_digest(str(info["secret"]).encode(), self.dataplane.secret.encode())
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            call = self._begin(MESSAGES if "messages" in request.path else CHAT, request.path)
            call.resp = resp
            self._local_error(call, 400, "invalid_request_error", "not a call this shim handed over", "bad_request")
            self._finish_soon(call)
            return
        call, pace = self._fast_call(info["call"])
        call.resp = resp
        call.pacer_wait_ms += info["pacer_wait_ms"]
        await self._guarded(call, self._resumed(request, call, pace, info))

    async def _resumed(self, request: Request, call: Call, pace: PaceRequest, info: dict[str, Any]) -> None:
        if info["head_sent"]:
            call.resp.begin(200, b"")  # the harness has the data plane's head; this one is dropped there
        last = await self._failed_attempt(call, pace, info["attempt"])
        if last is not None:
            await self._forward(request, call, request.body, pace, start=2, last=last)

    async def _failed_attempt(self, call: Call, pace: PaceRequest, a: dict[str, Any]) -> _Retry | None:
        """The data plane's failed first attempt, booked and metered as _forward does: how to retry it, or None
        when its error is terminal (then it was passed to the harness)."""
        how = a["how"]
        if how == "unreachable":
            await self._pace_settle(pace, None)
            return _Retry(502, {}, self._err_json(call, f"upstream unreachable: {a['error']}"))
        if how == "status":
            status, headers, data = a["status"], Headers([tuple(kv) for kv in a["headers"]]), a["body"].encode()
            if status == 429:
                await self._throttled(pace, headers, data)
            await self._pace_settle(pace, None)
            found = self.progress.discovered(headers, force=status == 429)
            if found:
                self._spawn(self.progress.record(found))
            if retryable_status(status, data):
                log.info("upstream %d (attempt 1), retrying", status)
                return _Retry(status, headers, data, headers.get("content-type", "application/json"))
            self._pass(call, status, headers, data, "error")
            return None
        if how == "body":
            used = self._account(call, None, True, est_output=call.max_out)
            await self._pace_settle(pace, used)
            return _Retry(502, {}, self._err_json(call, f"upstream failed: {a['error']}"))
        meter = self._meter(call.kind, a["meter"])
        await self._pace_settle(pace, self._stream_usage(call, meter, complete=False))
        log.info("stream failed before content (attempt 1), retrying")
        if how == "stream_early":
            return _Retry(502, {}, self._err_json(call, a["failure"]))
        return _Retry(529, {}, json.dumps(meter.error).encode())

    # ------------------------------------------------------------ the call

    async def _handle(self, request: Request, call: Call) -> None:
        if not self._authorized(request):
            return self._local_error(call, 401, "authentication_error", "invalid local token", "unauthorized")
        if request.too_large:
            return self._local_error(call, 413, "request_too_large",
                                     f"request body exceeds {self.cfg.max_body_bytes} bytes", "bad_request")
        if request.body_error is not None:  # a body that could not be decoded (e.g. bad content-encoding)
            return self._local_error(call, 400, "invalid_request_error",
                                     f"unreadable request body: {request.body_error}", "bad_request")
        raw = request.body
        try:
            body = loads(raw)
        except ValueError:
            return self._local_error(call, 400, "invalid_request_error", "request body is not valid JSON",
                                     "bad_request")
        if not isinstance(body, dict):
            return self._local_error(call, 400, "invalid_request_error", "request body must be a JSON object",
                                     "bad_request")
        call.stream = body.get("stream") is True
        if not isinstance(body.get("model"), str) or not body["model"]:
            return self._local_error(call, 400, "invalid_request_error", "missing required field: model",
                                     "bad_request")
        modified = False
        if body["model"] != self.cfg.model:
            body["model"] = self.cfg.model  # the shim is pinned to one model (and prices it)
            modified = True
        if call.kind == CHAT and call.stream:
            so = body.get("stream_options")
            if not (isinstance(so, dict) and so.get("include_usage")):
                body["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
                modified = True
        payload = dumps(body) if modified else raw
        call.payload_bytes = len(payload)

        # ---- caps
        if self.stopped:
            return self._refuse(call, self.stopped)
        if self.cfg.limits.max_turns is not None and not await self._turn_left():
            return self._refuse(call, "max_turns_exceeded")
        self.turns += 1
        max_out = body.get("max_tokens") or body.get("max_completion_tokens")
        if not isinstance(max_out, int) or max_out <= 0:
            max_out = min((self.price.max_output_tokens if self.price else None) or DEFAULT_MAX_OUTPUT,
                          DEFAULT_MAX_OUTPUT)
        nbytes = len(payload)
        try:
            which, ok, wait_ms, answered, hold_id, pace = await self.gate.hold(
                call.call_id, lambda: self._estimate(nbytes, max_out), (nbytes, max_out))
        except Exception as e:  # noqa: BLE001 - any store failure is answered the same way
            self.turns -= 1
            log.error("budget hold failed: %s", type(e).__name__)
            return self._local_error(call, 503, "api_error", "budget store unavailable", "error",
                                     headers=(("x-should-retry", "true"), ("retry-after", "2")))
        if which:
            self.turns -= 1
            scope = "attempt" if which == ATTEMPT_CAP else "run"
            return self._refuse(call, "budget_exceeded", f"the {scope} cost cap does not allow this call")
        call.max_out = max_out
        call.hold_id = hold_id  # settled in _after, whatever happens from here on
        first = (ok, wait_ms) if answered else None
        return await self._forward(request, call, payload, pace, first)

    def _estimate(self, nbytes: int, max_out: int) -> tuple[int, PaceRequest]:
        # never less for more bytes or more max_out (tickets rely on it when _sized: see Gate.hold)
        """A call's worst-case cost (micro-dollars) for its budget hold, and what it books with the pool."""
        est_in = (nbytes + 2) // 3  # generous: JSON overhead, ~3 bytes per token at worst
        if self.price:
            rates = self.price.rates(est_in)  # the tier the prompt may reach, at worst
            est = micro(est_in * rates.input + max_out * rates.output)
        else:
            est = 0
        return est, self._pace_request(nbytes, max_out)

    def _pace_request(self, nbytes: int, max_out: int) -> PaceRequest:
        """What the pool is charged up front. The prompt estimate is ~4 bytes a token (settled later anyway).
        Anthropic: only uncached input counts toward ITPM, estimated with the last call's cache-read share;
        OpenAI: the whole prompt counts."""
        prompt = (nbytes + 3) // 4
        if self.cfg.provider == "anthropic":
            prompt = int(prompt * (1.0 - self.cache_share))
        return PaceRequest(self.cfg.pool, prompt, max_out)

    def _limit_input(self, usage: Usage) -> int:
        """Tokens of a call that count toward the pool's input limit, by the provider's rules."""
        if self.cfg.provider == "anthropic":
            return usage.input_tokens + usage.cache_write_tokens
        return usage.input_tokens + usage.cached_tokens + usage.cache_write_tokens

    def _refuse(self, call: Call, reason: str, detail: str | None = None) -> None:
        if self.stopped is None:
            self.stopped = reason
            log.warning("stopping: %s", reason)
        msg = detail or ("the attempt's turn limit is reached" if reason == "max_turns_exceeded"
                         else "the cost cap does not allow this call")
        return self._local_error(call, 403, reason, f"{reason}: {msg}", reason)

    def _local_error(self, call: Call, status: int, etype: str, message: str, outcome: str,
                     headers: tuple = NO_RETRY) -> None:
        call.http_status = status
        call.outcome = outcome
        if call.resp.started:
            return self._end_stream(call, json.dumps(error_body(call.kind, etype, message)).encode())
        self._json(call.resp, error_body(call.kind, etype, message), status, headers)

    def _upstream_headers(self, request: Request, kind: str) -> list[tuple[str, str]]:
        h = [(k, v) for k, v in request.headers.raw if k.lower() not in _DROP_UP and k.lower() != "content-type"]
        h.append(("Accept-Encoding", "identity"))
        h.append(("Content-Type", "application/json"))
        if self._key:
            if kind == MESSAGES:
                h.append(("x-api-key", self._key))
            else:
                h.append(("Authorization", f"Bearer {self._key}"))
        return h

    async def _forward(self, request: Request, call: Call, payload: bytes, pace: PaceRequest,
                       first: tuple[bool, float] | None = None, start: int = 1, last: _Retry | None = None):
        """`first`: the ADMIT answer for the first attempt, when the gate already asked (HOLD+ADMIT). `start`,
        `last`: the attempt to make next and how the one before it failed (a call the data plane handed over)."""
        route = ROUTES[call.kind]
        derived = request.headers.derived  # a harness sends the same headers call after call: build it once
        head = derived.get(self._head_key)
        if head is None:
            head = derived[self._head_key] = self.http.head(route, self._upstream_headers(request, call.kind))
        for attempt in range(start, self.cfg.max_attempts + 1):
            if last is not None:
                call.retries += 1
                await asyncio.sleep(self.backoff.delay(attempt - 1, last.headers))
            if first is not None:
                call.pacer_wait_ms += await self.pacer.admitted(pace, first[0], first[1])
                first = None
            else:
                call.pacer_wait_ms += await self.pacer.admit(pace)
            try:
                # a non-stream 200, and a stream's head, go to the harness from the connection's callback
                resp = await self.http.post_head(head, payload, None if call.stream else call.answer_now,
                                                 call.begin_now if call.stream else None)
            except _UPSTREAM_ERRORS as e:
                last = _Retry(502, {}, self._err_json(call, f"upstream unreachable: {type(e).__name__}"))
                await self._pace_settle(pace, None)
                continue
            try:
                if resp.status != 200:
                    data = await resp.read()
                    if resp.status == 429:
                        await self._throttled(pace, resp.headers, data)
                    await self._pace_settle(pace, None)
                    self._discover(resp, force=resp.status == 429)
                    if retryable_status(resp.status, data):
                        last = _Retry(resp.status, resp.headers, data, resp.content_type)
                        log.info("upstream %d (attempt %d), retrying", resp.status, attempt)
                        continue
                    return self._pass(call, resp.status, resp.headers, data, "error")
                self._discover(resp)
                if not call.stream:
                    try:
                        data = await resp.read()
                    except _UPSTREAM_ERRORS as e:
                        # the provider answered (and billed): meter the worst case, estimated
                        used = self._account(call, None, True, est_output=call.max_out)
                        await self._pace_settle(pace, used)
                        last = _Retry(502, {}, self._err_json(call, f"upstream failed: {type(e).__name__}"))
                        continue
                    call.http_status = 200
                    # hand it to the harness first: metering, the ledger row and the settles come after
                    if not call.answered:
                        call.answer(resp.block, data)
                    used = self._account(call, usage_from_body(call.kind, data), estimated=False)
                    call.final_pace = (pace, used)
                    return None
                result = await self._stream(request, call, resp, pace)
                if isinstance(result, _Retry):
                    last = result
                    log.info("stream failed before content (attempt %d), retrying", attempt)
                    continue
                return None
            finally:
                resp.close()
        assert last is not None
        log.warning("upstream exhausted after %d attempts (last %d)", self.cfg.max_attempts, last.status)
        return self._pass(call, last.status, last.headers, last.body, "upstream_exhausted")

    def _discover(self, resp: Response, force: bool = False) -> None:
        """Record the pool's rate-limit headers (at most once a minute, or on a 429), off the call's path."""
        found = self.progress.discovered(resp, force)
        if found:
            self._spawn(self.progress.record(found))

    async def _pace_settle(self, pace: PaceRequest, used: Usage | None) -> None:
        """Settle an attempt with the pool: actual usage, or (failed) no output and the input kept."""
        try:
            if used is None:
                await self.pacer.settle(pace, None, 0)
            else:
                await self.pacer.settle(pace, self._limit_input(used), used.output_tokens)
        except Exception as e:  # noqa: BLE001 - a booking not refunded decays by itself
            log.warning("pacer settle failed: %s", type(e).__name__)

    async def _throttled(self, pace: PaceRequest, headers, body: bytes) -> None:
        try:
            await self.pacer.throttled(pace, retry_after_s(headers), throttled_dimension(headers, body))
        except Exception as e:  # noqa: BLE001 - the retry goes on; the pool learns from the next 429
            log.warning("pacer throttle update failed: %s", type(e).__name__)

    def _err_json(self, call: Call, message: str) -> bytes:
        return json.dumps(error_body(call.kind, "api_error", message)).encode()

    def _pass(self, call: Call, status: int, headers, body: bytes, outcome: str) -> None:
        call.http_status = status
        call.outcome = outcome
        if call.resp.started:
            return self._end_stream(call, body)
        h = [(k, v) for k, v in headers.items() if k.lower() not in _HOP and k.lower() != "x-should-retry"]
        h.append(("x-should-retry", "false"))
        if not any(k.lower() == "content-type" for k, _ in h):
            h.append(_JSON)
        try:
            call.resp.send(status, h, body)
        except ConnectionError:
            pass

    def _account(self, call: Call, raw: dict[str, Any] | None, estimated: bool, est_output: int = 0) -> Usage:
        """Meter one upstream attempt and add it to the call's row (a call's retries may each be billed)."""
        usage = normalise(call.kind, raw)
        if raw is None or estimated:
            estimated = True
            if raw is None or not (usage.input_tokens or usage.cached_tokens or usage.cache_write_tokens):
                usage.input_tokens = (call.payload_bytes + 3) // 4
            usage.output_tokens = max(usage.output_tokens, est_output)
        self._add(call, usage, raw, estimated)
        return usage

    def _add(self, call: Call, usage: Usage, raw: dict[str, Any] | None, estimated: bool) -> None:
        call.raws += (raw,)
        call.usage = usage if call.usage is None else call.usage + usage
        # the last attempt's usage verbatim; earlier billed attempts (retried after a cut) listed beside it
        call.raw_usage = (raw if len(call.raws) == 1
                          else {**(raw or {}), "evalplane_prior_attempts": list(call.raws[:-1])})
        call.estimated = call.estimated or estimated
        call.cost = round(call.cost + (self.price.cost(usage) if self.price else 0.0), 9)
        prompt = usage.input_tokens + usage.cached_tokens + usage.cache_write_tokens
        if not estimated and prompt:
            self.cache_share = usage.cached_tokens / prompt

    def _stream_usage(self, call: Call, meter: StreamMeter, complete: bool) -> Usage | None:
        """Meter a stream attempt: its usage events, else an estimate if the provider may have billed it.
        An error event before any usage or content is taken as not billed (nothing is recorded)."""
        if meter.saw_usage:
            return self._account(call, meter.raw, estimated=not complete, est_output=meter.delta_tokens)
        if meter.error is not None and not meter.meaningful and not meter.delta_tokens:
            return None
        return self._account(call, None, estimated=True, est_output=meter.delta_tokens)

    async def _stream(self, request: Request, call: Call, resp, pace: PaceRequest):
        """Relay a stream (shim/stream.py: held back until its first content event, then passed on as it
        arrives, from the upstream connection's callback); meter it; a _Retry if it failed before content."""
        relay = StreamRelay(call.kind, resp, call.resp, self.cfg.max_stream_buffer_bytes, self._loop)
        relay.start()
        meter = relay.meter
        try:
            outcome = await relay.wait(self.cfg.sock_read_timeout_s)
        except TimeoutError:
            relay.stop()
            outcome = "retry_early" if relay.phase == "hold" else "cut"
            relay.failure = "upstream stream failed: TimeoutError"
        except asyncio.CancelledError:  # shutdown while streaming: meter what went through, then go
            relay.stop()
            if relay.phase != "hold":
                call.http_status = 200
            call.outcome = "stream_error"
            self._stream_usage(call, meter, complete=False)
            raise
        if outcome == "retry_early":  # cut before content: retried, but what the provider billed is metered
            await self._pace_settle(pace, self._stream_usage(call, meter, complete=False))
            return _Retry(502, {}, self._err_json(call, relay.failure or "upstream stream failed"))
        if outcome == "retry_error":
            await self._pace_settle(pace, self._stream_usage(call, meter, complete=False))
            return _Retry(529, {}, json.dumps(meter.error).encode())

        # committed: the harness has (some of) the answer
        call.http_status = 200
        cut = relay.failure if outcome == "cut" else None
        if cut is None and meter.error is None and not meter.done:
            cut = "upstream stream ended early"
        complete = cut is None and meter.error is None
        used = self._stream_usage(call, meter, complete=complete)
        if complete:
            call.outcome = "ok"
        else:
            call.outcome = "stream_error"
            if cut is not None:
                log.warning("stream cut: %s", cut)
        if not relay.answer_ended:
            tail = b""
            if cut is not None and cut != CLIENT_GONE:
                # tell the harness the stream broke (both SDKs raise on an in-stream error)
                tail = self._sse_error(call.kind, cut)
            try:
                call.resp.finish(tail)
            except (ConnectionError, RuntimeError):
                pass
        call.final_pace = (pace, used)
        return None

    def _end_stream(self, call: Call, body: bytes) -> None:
        """An error for a stream whose head the harness already has (its retries failed before any content):
        the stream ends with it as an error event, as a provider ends a stream that fails (both SDKs raise on
        it). The ledger row keeps the error's status."""
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
            doc = error_body(call.kind, "api_error", body.decode("utf-8", "replace")[:500] or "upstream error")
        try:
            call.resp.finish(self._sse_error(call.kind, error=doc["error"]))
        except ConnectionError:
            pass

    @staticmethod
    def _sse_error(kind: str, message: str = "", error: dict[str, Any] | None = None) -> bytes:
        """An in-stream error event in the route's format: `error` (an error object) or one saying `message`."""
        if kind == MESSAGES:
            doc = {"type": "error", "error": error or {"type": "api_error", "message": message}}
            return b"event: error\ndata: " + json.dumps(doc).encode() + b"\n\n"
        doc = {"error": error or {"type": "server_error", "message": message}}
        return b"data: " + json.dumps(doc).encode() + b"\n\n"
