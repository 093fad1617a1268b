"""The three wire formats: usage normalisation, SSE framing, stream metering, error shapes and classification.

Only the events that carry usage or an error are JSON-decoded; content deltas are counted by size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import Field

from contract import models

CHAT, RESPONSES, MESSAGES = "chat", "responses", "messages"  # OpenAI chat completions and Responses; Anthropic
ROUTES = {"/v1/chat/completions": CHAT, "/v1/responses": RESPONSES, "/v1/messages": MESSAGES}


class Usage(models.Usage):
    """contract.models.Usage, plus the 1-hour share of the cache writes (priced apart, not in the ledger)."""

    cache_write_1h_tokens: int = Field(0, exclude=True)

    def __add__(self, other: models.Usage) -> Usage:
        return Usage(input_tokens=self.input_tokens + other.input_tokens,
                     cached_tokens=self.cached_tokens + other.cached_tokens,
                     cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
                     output_tokens=self.output_tokens + other.output_tokens,
                     cache_write_1h_tokens=self.cache_write_1h_tokens + getattr(other, "cache_write_1h_tokens", 0))


def _int(v: Any) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


def _write_1h(details: Any) -> int:
    """The 1-hour cache writes of an Anthropic `cache_creation` object (or LiteLLM's copy of it)."""
    return _int(details.get("ephemeral_1h_input_tokens")) if isinstance(details, dict) else 0


def normalise(kind: str, raw: dict[str, Any] | None) -> Usage:
    """Provider usage -> Usage (input_tokens uncached; the four add up to what was billed)."""
    if not raw:
        return Usage()
    if kind == MESSAGES:
        write = _int(raw.get("cache_creation_input_tokens"))
        return Usage(input_tokens=_int(raw.get("input_tokens")), cached_tokens=_int(raw.get("cache_read_input_tokens")),
                     cache_write_tokens=write, output_tokens=_int(raw.get("output_tokens")),
                     cache_write_1h_tokens=min(_write_1h(raw.get("cache_creation")), write))
    if kind == RESPONSES:  # input_tokens include the cached ones (and cache writes, where reported)
        details = raw.get("input_tokens_details") or {}
        cached, write = _int(details.get("cached_tokens")), _int(details.get("cache_write_tokens"))
        return Usage(input_tokens=max(_int(raw.get("input_tokens")) - cached - write, 0), cached_tokens=cached,
                     cache_write_tokens=write, output_tokens=_int(raw.get("output_tokens")))
    details = raw.get("prompt_tokens_details") or {}
    cached = _int(details.get("cached_tokens"))
    # LiteLLM's Anthropic->OpenAI mapping puts cache writes in prompt_tokens too
    write = _int(details.get("cache_creation_tokens")) or _int(raw.get("cache_creation_input_tokens"))
    w1h = _write_1h(details.get("cache_creation_token_details")) or _write_1h(raw.get("cache_creation"))
    return Usage(input_tokens=max(_int(raw.get("prompt_tokens")) - cached - write, 0), cached_tokens=cached,
                 cache_write_tokens=write, output_tokens=_int(raw.get("completion_tokens")),
                 cache_write_1h_tokens=min(w1h, write))


def loads(data: bytes | str) -> Any:
    """JSON by orjson (a 10-200 KB prompt on the call's path), by `json` what orjson refuses but JSON allows
    (integers past 64 bits). ValueError if it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(doc: Any) -> bytes:
    try:
        return orjson.dumps(doc)
    except TypeError:  # integers past 64 bits
        return json.dumps(doc, separators=(",", ":")).encode()


def _loads(data: bytes) -> Any:
    try:
        return loads(data)
    except ValueError:
        return None


def usage_from_body(kind: str, body: bytes) -> dict[str, Any] | None:
    """The raw usage object of a non-streaming response body, if any."""
    doc = _loads(body)
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


# ------------------------------------------------------------------ SSE


class SSESplitter:
    """Incremental SSE framing: feed() bytes, get complete (event, data) pairs."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes | None, bytes]]:
        buf = self.buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        if b"\n\n" not in buf:
            self.buf = buf
            return []
        *blocks, self.buf = buf.split(b"\n\n")
        out = []
        for block in blocks:
            event, data = None, []
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" "))
                elif line.startswith(b"event:"):
                    event = line[6:].strip()
            if event is not None or data:
                out.append((event, b"\n".join(data)))
        return out


_DELTA_OVERHEAD = 70  # bytes of JSON envelope around a delta's text, roughly
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')  # "usage": null on every chunk is common
_MESSAGES_PREAMBLE = {b"message_start", b"ping", b"content_block_start"}
_RESPONSES_PREAMBLE = {b"response.created", b"response.in_progress", b"response.queued",
                       b"response.output_item.added", b"response.content_part.added"}
_RESPONSES_FINAL = {b"response.completed", b"response.incomplete", b"response.failed"}


def _event_type(data: bytes) -> bytes:
    """The "type" of an event's JSON, for streams without `event:` lines."""
    i = data.find(b'"type"')
    part = data[i:i + 60].split(b'"') if i >= 0 else []
    return part[3] if len(part) > 3 else b""


@dataclass
class StreamMeter:
    """Follows one SSE stream: usage, content progress, errors, completion."""

    kind: str
    raw: dict[str, Any] = field(default_factory=dict)
    meaningful: bool = False  # a content event has arrived (after it, no transparent retry)
    done: bool = False  # the final event was seen
    error: dict[str, Any] | None = None
    error_before_content: bool = False
    delta_tokens: int = 0  # output estimate from delta sizes
    saw_usage: bool = False
    _envelope: int = 0  # size of an OpenAI chunk with empty content (learnt from the first chunk)

    def on_event(self, event: bytes | None, data: bytes) -> None:
        if self.kind == CHAT:
            return self._chat(data)
        if event is None:
            event = _event_type(data)
        if self.kind == MESSAGES:
            self._messages(event, data)
        else:
            self._responses(event, data)

    def _messages(self, event: bytes, data: bytes) -> None:
        if event == b"content_block_delta":
            self.meaningful = True
            self.delta_tokens += max(1, (len(data) - _DELTA_OVERHEAD) // 4)
        elif event == b"message_start":
            usage = ((_loads(data) or {}).get("message") or {}).get("usage")
            if isinstance(usage, dict):
                self._merge(usage)
        elif event == b"message_delta":
            self.meaningful = True
            usage = (_loads(data) or {}).get("usage")
            if isinstance(usage, dict):
                self._merge(usage)
        elif event == b"message_stop":
            self.meaningful = self.done = True
        elif event == b"error":
            self._error(_loads(data))

    def _responses(self, event: bytes, data: bytes) -> None:
        if event.endswith(b".delta"):
            self.meaningful = True
            self.delta_tokens += max(1, (len(data) - _DELTA_OVERHEAD) // 4)
        elif event in _RESPONSES_FINAL:
            doc = (_loads(data) or {}).get("response") or {}
            if isinstance(doc.get("usage"), dict):
                self._merge(doc["usage"])
            if event == b"response.failed":
                self._error({"error": doc.get("error") or {"type": "server_error", "message": "response failed"}})
            else:
                self.meaningful = self.done = True
        elif event == b"error":
            doc = _loads(data)
            self._error(doc if isinstance(doc, dict) else None)
        elif event not in _RESPONSES_PREAMBLE:
            self.meaningful = True

    def _chat(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.meaningful = self.done = True
            return
        has_usage = _USAGE_OBJECT.search(data) is not None
        if has_usage or b'"error"' in data or not self.meaningful:
            doc = _loads(data)
            if not isinstance(doc, dict):
                return
            if isinstance(doc.get("error"), dict):
                return self._error(doc)
            if isinstance(doc.get("usage"), dict):
                self._merge(doc["usage"])
            if not self._envelope and doc.get("choices"):
                self._envelope = len(data)
            if not self.meaningful:
                for choice in doc.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if (delta.get("content") or delta.get("tool_calls") or delta.get("refusal")
                            or delta.get("reasoning_content") or choice.get("finish_reason")):
                        self.meaningful = True
        if b'"delta"' in data and not has_usage:
            self.delta_tokens += max(1, (len(data) - (self._envelope or 2 * _DELTA_OVERHEAD)) // 4 + 1)

    def _merge(self, usage: dict[str, Any]) -> None:
        self.saw_usage = True
        self.raw.update((k, v) for k, v in usage.items() if v is not None)

    def _error(self, doc: dict[str, Any] | None) -> None:
        self.error = doc or {"error": {"type": "unknown"}}
        if not self.meaningful:
            self.error_before_content = True

    def usage(self) -> Usage:
        return normalise(self.kind, self.raw)


# ------------------------------------------------------------------ errors

RETRY_STATUSES = frozenset({408, 429, 502, 503, 504, 529})
_TERMINAL_MARKERS = (b"enforced_spend_limit_reached", b"insufficient_quota", b"billing_hard_limit")
_RETRY_MARKERS = (b"overloaded", b"rate_limit_error", b"server_is_overloaded")


def retryable_status(status: int, body: bytes) -> bool:
    """Whether an upstream error response should be retried by the shim."""
    if any(m in body for m in _TERMINAL_MARKERS):
        return False
    if status in RETRY_STATUSES:
        return True
    if status >= 500:
        low = body.lower()
        return any(m in low for m in _RETRY_MARKERS)  # LiteLLM turns a 529 into a 500
    return False


def retryable_stream_error(doc: dict[str, Any]) -> bool:
    text = json.dumps(doc).encode().lower()
    if any(m in text for m in _TERMINAL_MARKERS):
        return False
    return any(m in text for m in (b"overloaded", b"rate_limit", b"api_error", b"server_error"))


def error_body(kind: str, etype: str, message: str, code: str | None = None) -> dict[str, Any]:
    """An error body in the route's own format (all name the type; OpenAI's a code too)."""
    if kind == MESSAGES:
        return {"type": "error", "error": {"type": etype, "message": message}}
    return {"error": {"type": etype, "code": code or etype, "message": message, "param": None}}


def sse_error(kind: str, error: dict[str, Any]) -> bytes:
    """An in-stream error event ending a stream in the route's format (`error`: an error object); the SDKs
    raise on it. The Responses API's error event carries code and message at the top, and the object too."""
    if kind == MESSAGES:
        return b"event: error\ndata: " + dumps({"type": "error", "error": error}) + b"\n\n"
    if kind == RESPONSES:
        doc = {"type": "error", "code": error.get("code") or error.get("type"), "message": error.get("message"),
               "param": None, "error": error}
        return b"event: error\ndata: " + dumps(doc) + b"\n\n"
    return b"data: " + dumps({"error": error}) + b"\n\n"
