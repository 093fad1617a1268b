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

    def reset(self) -> None:
        self.stats.clear()
        self.limiter.clear()
        self.cache.clear()


STATE = web.AppKey("state", State)


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
    return app


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].stats.as_json())


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE].reset()
    return web.json_response({"ok": True})


def _handler(wire: Wire):
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _serve(request, wire, request.app[STATE])

    return handle


async def _serve(request: web.Request, wire: Wire, state: State) -> web.StreamResponse:
    arrived = time.perf_counter()
    ids = wire.request_id_header()
    key = wire.api_key(request.headers)
    if key is None or (state.config.api_key is not None and key != state.config.api_key):
        return web.json_response(wire.unauthorized(key), status=401, headers=ids)
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
        return await _stream(request, wire, state, call, billing, wire.frames(call, reply, billing), headers)
    await asyncio.sleep(_pace(state.config, billing.output_tokens, first=True))
    state.stats.bill(call.model, billing)
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
