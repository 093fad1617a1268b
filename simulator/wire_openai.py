"""OpenAI chat completions: bodies, SSE chunks, x-ratelimit-* headers and error shapes."""

from __future__ import annotations

import time
from typing import Any

from simulator.config import SimulatorConfig
from simulator.policy import Reply
from simulator.ratelimit import BucketState, Refusal, go_duration
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


def _error(message: str, type_: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _usage(billing: Billing) -> dict:
    prompt = billing.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": billing.output_tokens,
        "total_tokens": prompt + billing.output_tokens,
        "prompt_tokens_details": {"cached_tokens": billing.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    }


class OpenAIWire:
    route = "openai"
    writes_cache = False  # OpenAI caches automatically and charges nothing for writes

    def limits(self, config: SimulatorConfig) -> dict[str, int]:
        return {"requests": config.rpm, "tokens": config.tpm}

    def api_key(self, headers: Any) -> str | None:
        scheme, _, key = headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        return key.strip() or None

    def request_id_header(self) -> dict[str, str]:
        return {"x-request-id": new_id("req_")}

    def unauthorized(self, key: str | None) -> dict:
        if key is None:
            return _error(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                "invalid_request_error",
            )
        shown = f"{key[:3]}*****{key[-4:]}" if len(key) > 8 else key
        return _error(
            f"Incorrect API key provided: {shown}. You can find your API key at "
            "https://platform.openai.com/account/api-keys.",
            "invalid_request_error",
            "invalid_api_key",
        )

    def spend_limited(self, message: str) -> dict:
        return _error(message, "insufficient_quota", "enforced_spend_limit_reached")

    def bad_request(self, message: str) -> dict:
        return _error(message, "invalid_request_error")

    def parse(self, body: Any) -> Call:
        model = require(body, "model", str)
        messages = require(body, "messages", list)
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages: each message must be an object")
        options = body.get("stream_options") or {}
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        return Call(
            model=model,
            stream=bool(body.get("stream")),
            include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            prompt=Prompt.of({"tools": body.get("tools")} if body.get("tools") else None, messages),
            conversation=conversation_of(messages, offered(
                [(f.get("name"), f.get("parameters")) for f in (t.get("function") for t in tools(body))
                 if isinstance(f, dict)])),
        )

    def costs(self, call: Call, billing: Billing) -> dict[str, float]:
        """OpenAI charges TPM up front: the prompt plus max_tokens (or what it will write)."""
        return {"requests": 1, "tokens": billing.prompt_tokens + (call.max_tokens or billing.output_tokens)}

    def rate_headers(self, buckets: dict[str, BucketState]) -> dict[str, str]:
        headers = {}
        for dim, state in buckets.items():
            headers[f"x-ratelimit-limit-{dim}"] = str(state.limit)
            headers[f"x-ratelimit-remaining-{dim}"] = str(state.remaining)
            headers[f"x-ratelimit-reset-{dim}"] = go_duration(state.reset_s)
        return headers

    def rate_limited(self, refusal: Refusal, model: str) -> tuple[dict, dict[str, str]]:
        unit = "requests per min (RPM)" if refusal.dimension == "requests" else "tokens per min (TPM)"
        body = _error(
            f"Rate limit reached for {model} in organization org-simulator on {unit}: Limit {refusal.limit}. "
            f"Please try again in {go_duration(refusal.retry_after_s)}. "
            "Visit https://platform.openai.com/account/rate-limits to learn more.",
            refusal.dimension,
            "rate_limit_exceeded",
        )
        return body, self._retry_headers(refusal.retry_after_s)

    def _retry_headers(self, seconds: float) -> dict[str, str]:
        return {"retry-after": retry_after(seconds), "retry-after-ms": str(max(1, round(seconds * 1000)))}

    def injected(self, status: int) -> tuple[int, dict, dict[str, str]]:
        if status == 429:
            body = _error("Rate limit reached. Please try again in 1s.", "tokens", "rate_limit_exceeded")
            return 429, body, self._retry_headers(1.0)
        if status in (503, 529):  # OpenAI has no 529: overload is a 503
            return 503, _error("The server is overloaded or not ready yet.", "server_error"), {}
        return status, _error("The server had an error while processing your request.", "server_error"), {}

    def message(self, call: Call, reply: Reply, billing: Billing) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": reply.text, "refusal": None}
        if reply.call is not None:
            message["tool_calls"] = [
                {
                    "id": new_id("call_"),
                    "type": "function",
                    "function": {"name": reply.call.name, "arguments": reply.call.arguments},
                }
            ]
        return {
            "id": new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(reply)}],
            "usage": _usage(billing),
            "system_fingerprint": None,
        }

    def frames(self, call: Call, reply: Reply, billing: Billing) -> list[Frame]:
        head = {
            "id": new_id("chatcmpl-"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": call.model,
            "system_fingerprint": None,
        }
        extra = {"usage": None} if call.include_usage else {}

        def chunk(delta: dict, finish: str | None = None, tokens: float = 0.0) -> Frame:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return Frame(sse({**head, "choices": [choice], **extra}), tokens)

        frames = [chunk({"role": "assistant", "content": ""})]
        frames += [chunk({"content": p}, tokens=piece_tokens(p)) for p in pieces(reply.text)]
        if reply.call is not None:
            start = {
                "index": 0,
                "id": new_id("call_"),
                "type": "function",
                "function": {"name": reply.call.name, "arguments": ""},
            }
            frames.append(chunk({"tool_calls": [start]}))
            frames += [
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}, tokens=piece_tokens(p))
                for p in pieces(reply.call.arguments)
            ]
        frames.append(chunk({}, _finish(reply)))
        if call.include_usage:
            frames.append(Frame(sse({**head, "choices": [], "usage": _usage(billing)})))
        frames.append(Frame(sse("[DONE]")))
        return frames

    def stream_error(self) -> bytes:
        return sse(_error("Overloaded", "overloaded_error", "server_is_overloaded"), event="error")


def _finish(reply: Reply) -> str:
    return "tool_calls" if reply.call is not None else "stop"
