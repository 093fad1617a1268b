"""Answers kept for a shim's retry, so that a replica lost after answering does not get its call billed twice.

The shim names each upstream attempt (`x-litellm-call-id: <shim call id>:<n>`, which LiteLLM takes as its own call
id) and sends a retry with the attempts before it (`x-evalplane-replay-of`). This ASGI layer, around LiteLLM's app
in every replica, keeps each complete non-stream 200 answer in Valkey for `answer_ttl_s` before it goes out, and
answers a retry with an earlier attempt's kept answer (its bytes, its call id) instead of calling the provider again.
Kept answers are found only under the same gateway key's hash. Streams are not kept: the shim retries a stream only
when it failed before its first content.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from contract import keys as vkeys
from gateway.keys import key_hash

log = logging.getLogger("gateway")

CALL_ID = b"x-litellm-call-id"
REPLAY_OF = b"x-evalplane-replay-of"
REPLAYED = b"x-evalplane-replayed"

Send = Callable[[dict], Awaitable[None]]


def _token(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip().decode("latin-1")
    key = headers.get(b"x-api-key")
    return key.decode("latin-1") if key else None


class AnswerReplay:
    def __init__(self, app, valkey_of: Callable, ttl_s: Callable[[], float]):
        """`valkey_of()`: the replica's redis.asyncio client (made in the serving loop); `ttl_s()`: how long an
        answer is kept."""
        self.app, self.valkey_of, self.ttl_s = app, valkey_of, ttl_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        attempt, token = headers.get(CALL_ID), _token(headers)
        if not attempt or not token:
            return await self.app(scope, receive, send)
        owner = key_hash(token)
        if (prior := headers.get(REPLAY_OF)) and await self._replay(owner, prior.decode("latin-1").split(","), send):
            return None
        return await self.app(scope, receive, self._keeping(owner, attempt.decode("latin-1"), send))

    async def _replay(self, owner: str, attempts: list[str], send: Send) -> bool:
        try:
            async with self.valkey_of().pipeline(transaction=False) as p:
                for a in attempts:
                    p.hgetall(vkeys.gateway_answer(owner, a.strip()))
                found = await p.execute()
        except Exception as e:  # noqa: BLE001 - no replay: the retry goes to the provider, as it would without one
            log.warning("gateway replay: lookup failed (%s)", type(e).__name__)
            return False
        kept = next((f for f in found if f), None)
        if kept is None:
            return False
        head = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(kept[b"h"])]
        await send({"type": "http.response.start", "status": 200, "headers": [*head, (REPLAYED, b"true")]})
        await send({"type": "http.response.body", "body": kept[b"b"]})
        return True

    def _keeping(self, owner: str, attempt: str, send: Send) -> Send:
        """`send`, holding a non-stream 200 answer back until it is whole and kept."""
        held: list[dict] | None = None
        passing = False

        async def keeping(message: dict) -> None:
            nonlocal held, passing
            if passing:
                return await send(message)
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                if message["status"] != 200 or content_type.startswith(b"text/event-stream"):
                    passing = True
                    return await send(message)
                held = [message]
                return None
            if held is None:  # not a response message this layer knows
                return await send(message)
            held.append(message)
            if message.get("more_body"):
                return None
            start, body = held[0], b"".join(m.get("body", b"") for m in held[1:])
            held, passing = None, True
            await self._keep(owner, attempt, start, body)
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return None

        return keeping

    async def _keep(self, owner: str, attempt: str, start: dict, body: bytes) -> None:
        head = json.dumps([(k.decode("latin-1"), v.decode("latin-1")) for k, v in start.get("headers") or []])
        key = vkeys.gateway_answer(owner, attempt)
        try:
            async with self.valkey_of().pipeline(transaction=False) as p:
                p.hset(key, mapping={"h": head, "b": body})
                p.pexpire(key, max(1, round(self.ttl_s() * 1000)))
                await p.execute()
        except Exception as e:  # noqa: BLE001 - the answer goes out regardless; only a retry of it would be billed
            log.warning("gateway replay: keeping an answer failed (%s)", type(e).__name__)


def install(app, valkey_of: Callable, ttl_s: Callable[[], float]) -> None:
    """Put the layer around LiteLLM's app. LiteLLM loads our callback module while its app starts up, after Starlette
    has built the middleware stack, so the built stack is wrapped (add_middleware is refused by then)."""
    if getattr(app.state, "evalplane_answer_replay", False):
        return
    app.state.evalplane_answer_replay = True
    if app.middleware_stack is None:
        app.add_middleware(AnswerReplay, valkey_of=valkey_of, ttl_s=ttl_s)
    else:
        app.middleware_stack = AnswerReplay(app.middleware_stack, valkey_of, ttl_s)
