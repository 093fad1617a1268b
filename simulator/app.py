"""The aiohttp application: one request flow shared by the three wire formats, plus /_sim endpoints.

Flow: authenticate -> parse -> injected fault -> rate limits -> policy reply -> (paced) answer.
All state lives on the event loop thread, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from aiohttp import web

from simulator.config import SimulatorConfig
from simulator.faults import Faults
from simulator.keys import KeyStore, ProviderKey
from simulator.policy import Policy, load_policy
from simulator.ratelimit import RateLimiter
from simulator.stats import Stats
from simulator.tokens import Billing, PromptCache
from simulator.wire import BadRequest, Call, Frame, Wire
from simulator.wire_anthropic import AnthropicWire
from simulator.wire_openai import OpenAIWire
from simulator.wire_responses import ResponsesWire


@dataclass
class State:
    config: SimulatorConfig
    policy: Policy
    faults: Faults
    limiter: RateLimiter
    cache: PromptCache
    stats: Stats = field(default_factory=Stats)
    keys: KeyStore = field(default_factory=KeyStore)  # minted through the admin API

    def reset(self) -> None:
        self.stats.clear()
        self.keys.clear()
        self.limiter.clear()
        self.cache.clear()


STATE = web.AppKey("state", State)
WIRES = web.AppKey("wires", list)


def make_app(config: SimulatorConfig) -> web.Application:
    wires: list[Wire] = [OpenAIWire(), ResponsesWire(), AnthropicWire()]
    app = web.Application()
    app[STATE] = State(
        config=config,
        policy=load_policy(config),
        faults=Faults(config),
        limiter=RateLimiter({w.route: w.limits(config) for w in wires}),
        cache=PromptCache(config.cache_prompts),
    )
    openai, responses, anthropic = (_handler(w) for w in wires)
    app.router.add_post("/v1/chat/completions", openai)
    app.router.add_post("/chat/completions", openai)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/responses", responses)
    app.router.add_post("/v1/messages", anthropic)
    app.router.add_get("/_sim/health", _health)
    app.router.add_get("/_sim/stats", _stats)
    app.router.add_post("/_sim/reset", _reset)
    app.router.add_post("/_sim/limits", _limits)
    app.router.add_post("/_sim/outage", _outage)
    app.router.add_post("/_sim/admin/keys", _mint_key)
    app.router.add_get("/_sim/admin/keys/{id}", _key_usage)
    app.router.add_delete("/_sim/admin/keys/{id}", _revoke_key)
    # the same keys through OpenRouter's management API (dispatcher/provider_keys/openrouter.py drives it)
    app.router.add_post("/api/v1/keys", _openrouter_create)
    app.router.add_get("/api/v1/keys/{id}", _openrouter_get)
    app.router.add_delete("/api/v1/keys/{id}", _openrouter_delete)
    app[WIRES] = wires
    return app


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].stats.as_json())


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE].reset()
    return web.json_response({"ok": True})


async def _limits(request: web.Request) -> web.Response:
    """New per-minute limits (any of rpm, tpm, itpm, otpm) from now on, as a provider lowering or raising them."""
    state = request.app[STATE]
    state.config = state.config.model_copy(update={k: int(v) for k, v in (await request.json()).items()
                                                   if k in ("rpm", "tpm", "itpm", "otpm")})
    state.limiter.resize({w.route: w.limits(state.config) for w in request.app[WIRES]})
    return web.json_response({k: getattr(state.config, k) for k in ("rpm", "tpm", "itpm", "otpm")})


async def _outage(request: web.Request) -> web.Response:
    """A provider outage: {"seconds": N, "after_s": T (default 0), "status": 503/529/... or 0 (dropped)}."""
    body = await request.json()
    faults = request.app[STATE].faults
    faults.outage(float(body.get("after_s", 0)), float(body["seconds"]), int(body.get("status", 503)))
    return web.json_response({"after_s": float(body.get("after_s", 0)), "seconds": float(body["seconds"]),
                              "status": faults.outage_status})


def _admin(request: web.Request) -> None:
    """The admin API takes the organisation's key (config.api_key) as a bearer token, as management keys go."""
    config = request.app[STATE].config
    if config.api_key is None or request.headers.get("Authorization", "") != f"Bearer {config.api_key}":
        raise web.HTTPUnauthorized(text="the admin API needs the organisation's key")


async def _mint_key(request: web.Request) -> web.Response:
    _admin(request)
    body = await request.json()
    limit = body.get("limit_usd")
    k = request.app[STATE].keys.mint(str(body.get("name", "")), None if limit is None else float(limit))
    return web.json_response({**k.public(), "key": k.key}, status=201)


def _known_key(request: web.Request) -> ProviderKey:
    _admin(request)
    k = request.app[STATE].keys.get(request.match_info["id"])
    if k is None:
        raise web.HTTPNotFound(text="no such key")
    return k


async def _key_usage(request: web.Request) -> web.Response:
    return web.json_response(_known_key(request).public())


async def _revoke_key(request: web.Request) -> web.Response:
    k = _known_key(request)
    request.app[STATE].keys.revoke(k.id)
    return web.json_response(k.public())


def _openrouter_key(k: ProviderKey) -> dict:
    """A key as OpenRouter's management API shows it: its hash, limit and usage in USD (no calls, no tokens)."""
    left = None if k.limit_usd is None else max(k.limit_usd - k.usage.cost_usd, 0.0)
    return {"hash": k.id, "name": k.name, "label": k.key[:12] + "...", "disabled": k.revoked, "limit": k.limit_usd,
            "limit_remaining": left, "usage": k.usage.cost_usd, "created_at": None, "updated_at": None}


async def _openrouter_create(request: web.Request) -> web.Response:
    _admin(request)
    body = await request.json()
    limit = body.get("limit")
    k = request.app[STATE].keys.mint(str(body.get("name", "")), None if limit is None else float(limit))
    return web.json_response({"data": _openrouter_key(k), "key": k.key}, status=201)


def _live_key(request: web.Request) -> ProviderKey:
    k = _known_key(request)
    if k.revoked:  # OpenRouter deletes a key: it is gone from the API
        raise web.HTTPNotFound(text="no such key")
    return k


async def _openrouter_get(request: web.Request) -> web.Response:
    return web.json_response({"data": _openrouter_key(_live_key(request))})


async def _openrouter_delete(request: web.Request) -> web.Response:
    request.app[STATE].keys.revoke(_live_key(request).id)
    return web.json_response({"deleted": True})


def _handler(wire: Wire):
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _serve(request, wire, request.app[STATE])

    return handle


async def _serve(request: web.Request, wire: Wire, state: State) -> web.StreamResponse:
    arrived = time.perf_counter()
    ids = wire.request_id_header()
    key = wire.api_key(request.headers)
    minted = state.keys.by_key(key) if key else None
    if minted is None and (key is None or (state.config.api_key is not None and key != state.config.api_key)):
        return web.json_response(wire.unauthorized(key), status=401, headers=ids)
    if minted is not None and (refused := state.keys.refusal(minted)) is not None:
        status, message = refused
        body = wire.unauthorized(key) if status == 401 else wire.spend_limited(message)
        return web.json_response(body, status=status, headers=ids)
    try:
        call = wire.parse(await request.json())
    except ValueError:
        return web.json_response(
            wire.bad_request("We could not parse the JSON body of your request."), status=400, headers=ids
        )
    except BadRequest as e:
        return web.json_response(wire.bad_request(str(e)), status=400, headers=ids)

    limits = state.limiter.for_model(wire.route, call.model)
    state.stats.model(call.model).requests += 1
    if state.faults.in_outage():
        state.stats.model(call.model).outage += 1
        if state.faults.outage_status == 0:  # unreachable: the connection closes with no answer
            request.transport.close()
            return web.Response(status=503)
        status, body, extra = wire.injected(state.faults.outage_status)
        return web.json_response(body, status=status, headers={**ids, **extra})
    if (injected := state.faults.status()) is not None:
        status, body, extra = wire.injected(injected)
        state.stats.error(call.model, status)
        return web.json_response(
            body, status=status, headers={**ids, **wire.rate_headers(limits.snapshot()), **extra}
        )

    reply = state.policy.reply(call.conversation)
    cached = state.cache.cached_tokens(wire.route, call.prompt)
    billing = Billing.of(call.prompt, cached, reply.output_tokens, writes_cache=wire.writes_cache)
    if (refusal := limits.admit(wire.costs(call, billing))) is not None:
        body, extra = wire.rate_limited(refusal, call.model)
        state.stats.error(call.model, 429)
        return web.json_response(
            body, status=429, headers={**ids, **wire.rate_headers(limits.snapshot()), **extra}
        )
    state.cache.remember(wire.route, call.prompt)

    headers = {**ids, **wire.rate_headers(limits.snapshot())}
    if state.config.report_timing:
        headers["x-simulator-arrived"] = repr(arrived)
    if call.stream:
        return await _stream(request, wire, state, call, billing, wire.frames(call, reply, billing), headers, minted)
    await asyncio.sleep(_pace(state.config, billing.output_tokens, first=True))
    state.stats.bill(call.model, billing)
    if minted is not None:
        state.keys.charge(minted, call.model, billing)
    if state.config.report_timing:
        headers["x-simulator-sent"] = repr(time.perf_counter())
    return web.json_response(wire.message(call, reply, billing), headers=headers)


def _pace(config: SimulatorConfig, tokens: float, *, first: bool) -> float:
    """Seconds to wait before sending `tokens` output tokens (the first ones also wait out the TTFT)."""
    ttft = config.ttft_ms / 1000 if first else 0.0
    return ttft + (tokens / config.tokens_per_s if config.tokens_per_s else 0.0)


async def _stream(
    request: web.Request,
    wire: Wire,
    state: State,
    call: Call,
    billing: Billing,
    frames: list[Frame],
    headers: dict[str, str],
    minted: ProviderKey | None = None,
) -> web.StreamResponse:
    timing = state.config.report_timing
    if timing:
        headers = {**headers, "x-simulator-sent": repr(time.perf_counter())}
    response = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    if state.faults.stream_error():
        state.stats.model(call.model).stream_errors += 1
        await response.write(wire.stream_error())
        await response.write_eof()
        return response

    content = [i for i, frame in enumerate(frames) if frame.tokens]
    cut_at = content[len(content) // 2] if content and state.faults.stream_cut() else None
    sent = 0.0
    try:
        for i, frame in enumerate(frames):
            if i == cut_at:
                state.stats.model(call.model).stream_cuts += 1
                request.transport.close()
                return response
            if frame.tokens:
                await asyncio.sleep(_pace(state.config, frame.tokens, first=sent == 0))
                sent += frame.tokens
            if timing and (frame.tokens or i == len(frames) - 1):  # an SSE comment: clients skip it
                await response.write(b": sent=%r\n\n%b" % (time.perf_counter(), frame.data))
                continue
            await response.write(frame.data)
        await response.write_eof()
        sent = billing.output_tokens
        return response
    finally:  # a cut or a client that went away is billed the output it was sent
        state.stats.bill(call.model, billing.with_output(math.ceil(sent)))
        if minted is not None:
            state.keys.charge(minted, call.model, billing.with_output(math.ceil(sent)))
