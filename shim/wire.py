"""Wire formats: SSE splitting, usage extraction and normalisation, error classification.

Only what carries usage (or an error) is JSON-decoded; content deltas are counted by size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

CHAT = "openai"  # /v1/chat/completions
MESSAGES = "anthropic"  # /v1/messages

# ------------------------------------------------------------------ usage


class Usage:
    """Normalised token usage, as contract.models.Usage (input_tokens uncached; the four add up to what was
    billed), plus the 1-hour share of the cache writes (priced apart). A plain class: no pydantic in the shim."""

    __slots__ = ("cache_write_1h_tokens", "cache_write_tokens", "cached_tokens", "input_tokens", "output_tokens")

    def __init__(self, input_tokens: int = 0, cached_tokens: int = 0, cache_write_tokens: int = 0,
                 output_tokens: int = 0, cache_write_1h_tokens: int = 0):
        self.input_tokens = input_tokens
        self.cached_tokens = cached_tokens
        self.cache_write_tokens = cache_write_tokens
        self.output_tokens = output_tokens
        self.cache_write_1h_tokens = cache_write_1h_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.input_tokens + other.input_tokens, self.cached_tokens + other.cached_tokens,
                     self.cache_write_tokens + other.cache_write_tokens, self.output_tokens + other.output_tokens,
                     self.cache_write_1h_tokens + other.cache_write_1h_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Usage) and self.model_dump() == other.model_dump() and (
            self.cache_write_1h_tokens == other.cache_write_1h_tokens)

    __hash__ = None  # type: ignore[assignment]

    def model_dump(self) -> dict[str, int]:
        """The four fields of contract.models.Usage."""
        return {"input_tokens": self.input_tokens, "cached_tokens": self.cached_tokens,
                "cache_write_tokens": self.cache_write_tokens, "output_tokens": self.output_tokens}

    def __repr__(self) -> str:
        return f"Usage({self.model_dump()}, cache_write_1h_tokens={self.cache_write_1h_tokens})"


def _write_1h(details: Any) -> int:
    """The 1-hour cache writes of an Anthropic `cache_creation` object (or LiteLLM's copy of it)."""
    return _int(details.get("ephemeral_1h_input_tokens")) if isinstance(details, dict) else 0


def normalise(kind: str, raw: dict[str, Any] | None) -> Usage:
    """Provider usage -> Usage (input_tokens uncached; the four add up to what was billed)."""
    if not raw:
        return Usage()
    if kind == MESSAGES:
        write = _int(raw.get("cache_creation_input_tokens"))
        return Usage(
            input_tokens=_int(raw.get("input_tokens")),
            cached_tokens=_int(raw.get("cache_read_input_tokens")),
            cache_write_tokens=write,
            output_tokens=_int(raw.get("output_tokens")),
            cache_write_1h_tokens=min(_write_1h(raw.get("cache_creation")), write),
        )
    details = raw.get("prompt_tokens_details") or {}
    cached = _int(details.get("cached_tokens"))
    # LiteLLM's Anthropic->OpenAI mapping puts cache writes in prompt_tokens too
    write = _int(details.get("cache_creation_tokens")) or _int(raw.get("cache_creation_input_tokens"))
    prompt = _int(raw.get("prompt_tokens"))
    w1h = _write_1h(details.get("cache_creation_token_details")) or _write_1h(raw.get("cache_creation"))
    return Usage(
        input_tokens=max(prompt - cached - write, 0),
        cached_tokens=cached,
        cache_write_tokens=write,
        output_tokens=_int(raw.get("completion_tokens")),
        cache_write_1h_tokens=min(w1h, write),
    )


def _int(v: Any) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


def usage_from_body(kind: str, body: bytes) -> dict[str, Any] | None:
    """The raw usage object of a non-streaming response body, if any."""
    doc = _loads(body)
    if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
        return doc["usage"]
    return None


def estimate_tokens(nbytes: int) -> int:
    """A generous token estimate for a byte count (JSON overhead makes it an over-estimate)."""
    return (nbytes + 2) // 3


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
            # the usual shapes first, without splitting into lines: "event: x\ndata: {...}" and "data: {...}"
            if block.startswith(b"event:"):
                nl = block.find(b"\n")
                if nl > 0 and block.startswith(b"data:", nl + 1) and block.find(b"\n", nl + 1) < 0:
                    out.append((block[6:nl].strip(), block[nl + 6:].lstrip(b" ")))
                    continue
            elif block.startswith(b"data:") and b"\n" not in block:
                out.append((None, block[5:].lstrip(b" ")))
                continue
            event = None
            data: list[bytes] = []
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" ") if len(line) > 5 else b"")
                elif line.startswith(b"event:"):
                    event = line[6:].strip()
            if event is not None or data:
                out.append((event, b"\n".join(data)))
        return out


_ANTHROPIC_PREAMBLE = {b"message_start", b"ping", b"content_block_start"}
_DELTA_OVERHEAD = 70  # bytes of JSON envelope around an Anthropic delta's text, roughly
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')  # "usage": null on every chunk is common


@dataclass
class StreamMeter:
    """Follows one SSE stream: usage, content progress, errors, completion."""

    kind: str
    raw: dict[str, Any] = field(default_factory=dict)
    meaningful: bool = False  # a content event has arrived (after it, no transparent retry)
    done: bool = False  # message_stop / [DONE] seen
    error: dict[str, Any] | None = None
    error_before_content: bool = False
    delta_tokens: int = 0  # output estimate from delta sizes
    saw_usage: bool = False
    _envelope: int = 0  # size of an OpenAI chunk with empty content (learnt from the first chunk)

    def on_event(self, event: bytes | None, data: bytes) -> None:
        if self.kind == MESSAGES:
            self._anthropic(event, data)
        else:
            self._openai(data)

    def _anthropic(self, event: bytes | None, data: bytes) -> None:
        if event is None:  # tolerate streams without event: lines
            i = data.find(b'"type"')
            event = data[i:i + 40].split(b'"')[3] if i >= 0 and data[i:i + 40].count(b'"') >= 4 else b""
        if event == b"content_block_delta":
            self.meaningful = True
            self.delta_tokens += max(1, (len(data) - _DELTA_OVERHEAD) // 4)
        elif event == b"message_start":
            doc = _loads(data)
            usage = ((doc or {}).get("message") or {}).get("usage")
            if isinstance(usage, dict):
                self._merge(usage)
        elif event == b"message_delta":
            self.meaningful = True
            doc = _loads(data)
            usage = (doc or {}).get("usage")
            if isinstance(usage, dict):
                self._merge(usage)
        elif event == b"message_stop":
            self.meaningful = True
            self.done = True
        elif event == b"error":
            self._error(_loads(data))
        elif event not in _ANTHROPIC_PREAMBLE:
            pass  # unknown events are passed through untouched

    def _openai(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.meaningful = True
            self.done = True
            return
        has_usage = _USAGE_OBJECT.search(data) is not None
        if has_usage or b'"error"' in data or not self.meaningful:
            doc = _loads(data)
            if not isinstance(doc, dict):
                return
            if isinstance(doc.get("error"), dict):
                self._error(doc)
                return
            if isinstance(doc.get("usage"), dict):
                self._merge(doc["usage"])
            if not self._envelope and doc.get("choices"):
                self._envelope = len(data)
            if not self.meaningful:
                for choice in doc.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if (
                        delta.get("content")
                        or delta.get("tool_calls")
                        or delta.get("refusal")
                        or delta.get("reasoning_content")
                        or choice.get("finish_reason")
                    ):
                        self.meaningful = True
        if b'"delta"' in data and not has_usage:
            self.delta_tokens += max(1, (len(data) - (self._envelope or 2 * _DELTA_OVERHEAD)) // 4 + 1)

    def _merge(self, usage: dict[str, Any]) -> None:
        self.saw_usage = True
        for k, v in usage.items():
            if v is not None:
                self.raw[k] = v

    def _error(self, doc: dict[str, Any] | None) -> None:
        self.error = doc or {"error": {"type": "unknown"}}
        if not self.meaningful:
            self.error_before_content = True

    def usage(self) -> Usage:
        return normalise(self.kind, self.raw)


def loads(data: bytes) -> Any:
    """JSON parsed by orjson (a harness's 10-200 KB prompt ~3x faster than `json`, on the call's path), by
    `json` what orjson refuses but JSON allows (integers past 64 bits). ValueError if it is not JSON."""
    try:
        return orjson.loads(data)
    except ValueError:
        return json.loads(data)


def dumps(doc: Any) -> bytes:
    """Compact JSON by orjson (~15x faster than `json` on a long prompt), by `json` past 64-bit integers."""
    try:
        return orjson.dumps(doc)
    except TypeError:
        return json.dumps(doc, separators=(",", ":")).encode()


def _loads(data: bytes) -> Any:
    try:
        return loads(data)
    except ValueError:
        return None


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


def error_body(kind: str, status_type: str, message: str) -> dict[str, Any]:
    """An error body in the route's own format (both name the type)."""
    if kind == MESSAGES:
        return {"type": "error", "error": {"type": status_type, "message": message}}
    return {"error": {"type": status_type, "code": status_type, "message": message, "param": None}}
