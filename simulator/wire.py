"""What both provider wire formats share: the parsed call, SSE frames, and the route interface."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from simulator.config import SimulatorConfig
from simulator.policy import Conversation, OfferedTool, Reply
from simulator.ratelimit import BucketState, Refusal
from simulator.tokens import Billing, Prompt

PIECE_CHARS = 16  # about four tokens per streamed delta


class BadRequest(Exception):
    """The request is malformed; the message goes into the provider's 400 body."""


def tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's `tools` that are objects."""
    offered = body.get("tools")
    return [t for t in offered if isinstance(t, dict)] if isinstance(offered, list) else []


def offered(pairs: list[tuple[Any, Any]]) -> tuple[OfferedTool, ...]:
    """The request's tools as (name, JSON schema of the arguments) pairs, those that are well formed."""
    return tuple(OfferedTool(name, params) for name, params in pairs
                 if isinstance(name, str) and isinstance(params, dict))


@dataclass(frozen=True)
class Call:
    model: str
    stream: bool
    include_usage: bool  # OpenAI stream_options.include_usage
    max_tokens: int | None
    prompt: Prompt
    conversation: Conversation


@dataclass(frozen=True)
class Frame:
    """One SSE event on the wire, and how many output tokens it carries (for pace and partial bills)."""

    data: bytes
    tokens: float = 0.0


def sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def pieces(text: str) -> list[str]:
    return [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]


def piece_tokens(piece: str) -> float:
    return len(piece) / 4


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text blocks of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            b.get("text", "")
            for b in content
            if isinstance(b, dict) and b.get("type") in ("text", "input_text", "output_text")
        )
    return ""


def conversation_of(messages: list[dict[str, Any]], tools: tuple[OfferedTool, ...] = (),
                    system: Any = None) -> Conversation:
    """Chat messages (chat completions, Anthropic messages) as the policy reads them; a `system` message inside
    `messages` counts as system text."""
    turns = tuple((m["role"], text_of(m.get("content"))) for m in messages if m.get("role") in ("user", "assistant"))
    systems = [text_of(system)] + [text_of(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    return Conversation(turns=turns, tools=tools, system="\n".join(s for s in systems if s))


def require(body: Any, field: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    value = body.get(field)
    if value is None:
        raise BadRequest(f"{field}: Field required")
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(f"{field}: invalid type")
    return value


class Wire(Protocol):
    """One provider's route: how it authenticates, parses, limits, answers and fails."""

    route: str
    writes_cache: bool  # whether cache_control markers create cache-write tokens

    def limits(self, config: SimulatorConfig) -> dict[str, int]: ...
    def api_key(self, headers: Any) -> str | None: ...
    def request_id_header(self) -> dict[str, str]: ...
    def unauthorized(self, key: str | None) -> dict: ...
    def bad_request(self, message: str) -> dict: ...
    def parse(self, body: Any) -> Call: ...
    def costs(self, call: Call, billing: Billing) -> dict[str, float]: ...
    def rate_headers(self, buckets: dict[str, BucketState]) -> dict[str, str]: ...
    def rate_limited(self, refusal: Refusal, model: str) -> tuple[dict, dict[str, str]]: ...
    def spend_limited(self, message: str) -> dict: ...
    def injected(self, status: int) -> tuple[int, dict, dict[str, str]]: ...
    def message(self, call: Call, reply: Reply, billing: Billing) -> dict: ...
    def frames(self, call: Call, reply: Reply, billing: Billing) -> list[Frame]: ...
    def stream_error(self) -> bytes: ...
