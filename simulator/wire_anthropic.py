"""Anthropic messages: bodies, the SSE event sequence, anthropic-ratelimit-* headers and errors."""

from __future__ import annotations

from typing import Any

from simulator.config import SimulatorConfig
from simulator.policy import Reply
from simulator.ratelimit import BucketState, Refusal, rfc3339_after
from simulator.tokens import Billing, Prompt
from simulator.wire import (
    BadRequest,
    Call,
    Frame,
    conversation_of,
    new_id,
    offered,
    piece_tokens,
    pieces,
    require,
    retry_after,
    sse,
    tools,
)

HEADER_PREFIX = {"requests": "requests", "input_tokens": "input-tokens", "output_tokens": "output-tokens"}
ERROR_TYPES = {429: "rate_limit_error", 529: "overloaded_error", 500: "api_error", 503: "api_error"}
ERROR_MESSAGES = {
    429: "Rate limited. Please try again later.",
    529: "Overloaded",
    500: "Internal server error",
}


def _error(type_: str, message: str) -> dict:
    return {"type": "error", "error": {"type": type_, "message": message}, "request_id": new_id("req_")}


def _usage(billing: Billing, output_tokens: int) -> dict:
    return {
        "input_tokens": billing.input_tokens,
        "cache_creation_input_tokens": billing.cache_write_tokens,
        "cache_read_input_tokens": billing.cached_tokens,
        "output_tokens": output_tokens,
    }


class AnthropicWire:
    route = "anthropic"
    writes_cache = True  # cache_control markers create cache-write tokens

    def limits(self, config: SimulatorConfig) -> dict[str, int]:
        return {"requests": config.rpm, "input_tokens": config.itpm, "output_tokens": config.otpm}

    def api_key(self, headers: Any) -> str | None:
        """x-api-key; the anthropic SDK (2.x) sends the same key as `Authorization: Bearer` instead."""
        scheme, _, bearer = headers.get("Authorization", "").partition(" ")
        return (
            headers.get("x-api-key", "").strip()
            or (bearer.strip() if scheme.lower() == "bearer" else "")
            or None
        )

    def request_id_header(self) -> dict[str, str]:
        return {"request-id": new_id("req_")}

    def unauthorized(self, key: str | None) -> dict:
        return _error(
            "authentication_error", "x-api-key header is required" if key is None else "invalid x-api-key"
        )

    def spend_limited(self, message: str) -> dict:
        body = _error("rate_limit_error", message)
        body["error"]["details"] = {"error_code": "enforced_spend_limit_reached"}
        return body

    def bad_request(self, message: str) -> dict:
        return _error("invalid_request_error", message)

    def parse(self, body: Any) -> Call:
        model = require(body, "model", str)
        messages = require(body, "messages", list)
        max_tokens = require(body, "max_tokens", int)
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages: each message must be an object")
        preamble = {k: body[k] for k in ("system", "tools") if body.get(k)}
        return Call(
            model=model,
            stream=bool(body.get("stream")),
            include_usage=False,
            max_tokens=max_tokens,
            prompt=Prompt.of(preamble or None, messages),
            conversation=conversation_of(messages, offered([(t.get("name"), t.get("input_schema")) for t in tools(body)]),
                                         body.get("system")),
        )

    def costs(self, call: Call, billing: Billing) -> dict[str, float]:
        """Cache reads do not count toward ITPM; output is charged what the reply will use."""
        return {
            "requests": 1,
            "input_tokens": billing.input_tokens + billing.cache_write_tokens,
            "output_tokens": billing.output_tokens,
        }

    def rate_headers(self, buckets: dict[str, BucketState]) -> dict[str, str]:
        headers = {}
        for dim, state in buckets.items():
            self._put(headers, HEADER_PREFIX[dim], state.limit, state.remaining, state.reset_s)
        tokens = [buckets[d] for d in ("input_tokens", "output_tokens") if d in buckets]
        if tokens:  # the combined input + output limit Anthropic also reports
            self._put(
                headers,
                "tokens",
                sum(s.limit for s in tokens),
                sum(s.remaining for s in tokens),
                max(s.reset_s for s in tokens),
            )
        return headers

    @staticmethod
    def _put(headers: dict[str, str], name: str, limit: int, remaining: int, reset_s: float) -> None:
        headers[f"anthropic-ratelimit-{name}-limit"] = str(limit)
        headers[f"anthropic-ratelimit-{name}-remaining"] = str(remaining)
        headers[f"anthropic-ratelimit-{name}-reset"] = rfc3339_after(reset_s)

    def rate_limited(self, refusal: Refusal, model: str) -> tuple[dict, dict[str, str]]:
        unit = refusal.dimension.replace("_", " ")
        body = _error(
            "rate_limit_error",
            f"This request would exceed the rate limit for your organization of {refusal.limit} {unit} "
            f"per minute for {model}. For details, refer to: https://docs.claude.com/en/api/rate-limits.",
        )
        return body, {"retry-after": retry_after(refusal.retry_after_s)}

    def injected(self, status: int) -> tuple[int, dict, dict[str, str]]:
        body = _error(ERROR_TYPES.get(status, "api_error"), ERROR_MESSAGES.get(status, "Service unavailable"))
        return status, body, {"retry-after": "1"} if status == 429 else {}

    def message(self, call: Call, reply: Reply, billing: Billing) -> dict:
        content: list[dict[str, Any]] = [{"type": "text", "text": reply.text}]
        if reply.call is not None:
            content.append(
                {"type": "tool_use", "id": new_id("toolu_"), "name": reply.call.name, "input": reply.call.input}
            )
        return {
            **self._envelope(call),
            "content": content,
            "stop_reason": _stop(reply),
            "stop_sequence": None,
            "usage": _usage(billing, billing.output_tokens),
        }

    @staticmethod
    def _envelope(call: Call) -> dict:
        return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": call.model}

    def frames(self, call: Call, reply: Reply, billing: Billing) -> list[Frame]:
        start = {
            **self._envelope(call),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(billing, 1),
        }
        frames = [
            Frame(sse({"type": "message_start", "message": start}, "message_start")),
            Frame(
                sse(
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                    "content_block_start",
                )
            ),
            Frame(sse({"type": "ping"}, "ping")),
        ]
        frames += [self._delta(0, {"type": "text_delta", "text": p}, p) for p in pieces(reply.text)]
        frames.append(self._stop_block(0))
        if reply.call is not None:
            block = {"type": "tool_use", "id": new_id("toolu_"), "name": reply.call.name, "input": {}}
            frames.append(
                Frame(
                    sse(
                        {"type": "content_block_start", "index": 1, "content_block": block},
                        "content_block_start",
                    )
                )
            )
            frames += [
                self._delta(1, {"type": "input_json_delta", "partial_json": p}, p)
                for p in pieces(reply.call.arguments)
            ]
            frames.append(self._stop_block(1))
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": _stop(reply), "stop_sequence": None},
            "usage": {"output_tokens": billing.output_tokens},
        }
        frames.append(Frame(sse(delta, "message_delta")))
        frames.append(Frame(sse({"type": "message_stop"}, "message_stop")))
        return frames

    @staticmethod
    def _delta(index: int, delta: dict, piece: str) -> Frame:
        return Frame(
            sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta"),
            piece_tokens(piece),
        )

    @staticmethod
    def _stop_block(index: int) -> Frame:
        return Frame(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))

    def stream_error(self) -> bytes:
        return sse({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "error")


def _stop(reply: Reply) -> str:
    return "tool_use" if reply.call is not None else "end_turn"
