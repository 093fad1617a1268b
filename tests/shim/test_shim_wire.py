"""Pure pieces: SSE framing under any chunking, usage normalisation, error classification, retry-after."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from shimtest import anthropic_stream

from shim.retry import Backoff, retry_after_s
from shim.wire import CHAT, MESSAGES, SSESplitter, StreamMeter, normalise, retryable_status


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=30), crlf=st.booleans())
def test_sse_framing_independent_of_chunking(cuts, crlf):
    stream = anthropic_stream("some text " * 20, input_tokens=1200, output_tokens=60)
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    bounds = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    meter, split, events = StreamMeter(MESSAGES), SSESplitter(), []
    for a, b in itertools.pairwise(bounds):
        for ev in split.feed(stream[a:b]):
            events.append(ev)
            meter.on_event(*ev)
    assert [e for e, _ in events] == [b"message_start", b"content_block_start", b"content_block_delta",
                                      b"content_block_stop", b"message_delta", b"message_stop"]
    assert meter.done and meter.meaningful and meter.error is None
    assert meter.usage().input_tokens == 1200 and meter.usage().output_tokens == 60


def test_sse_blocks_of_every_shape():
    """The usual two shapes take a short path; the rest (several data lines, id/retry lines, comments, an event
    with no data, data before its event name, no space after the colon) are read line by line."""
    stream = (b"event: a\ndata: {\"x\": 1}\n\n" b"data: [DONE]\n\n" b": keep-alive\n\n" b"event:b\ndata:{}\n\n"
              b"id: 5\nevent: c\ndata: one\ndata: two\n\n" b"event: d\n\n" b"data:\n\n" b"data: p\nevent: e\n\n"
              b"event: f\ndata: q\nid: 9\n\n" b"retry: 10\n\n" b"event:  g \ndata:   r\n\n")
    got = SSESplitter().feed(stream)
    assert got == [(b"a", b'{"x": 1}'), (None, b"[DONE]"), (b"b", b"{}"), (b"c", b"one\ntwo"), (b"d", b""),
                   (None, b""), (b"e", b"p"), (b"f", b"q"), (b"g", b"r")]


def test_openai_stream_meter_decodes_only_usage():
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi there"},
             "finish_reason": None}], "usage": None}
    role = {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    usage = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 60}}
    m = StreamMeter(CHAT)
    m.on_event(None, json.dumps(role).encode())
    assert not m.meaningful  # a role-only chunk is not content yet (a retry is still transparent)
    m.on_event(None, json.dumps(chunk).encode())
    assert m.meaningful and m.delta_tokens >= 1
    m.on_event(None, json.dumps({**chunk, "choices": [], "usage": usage}).encode())
    m.on_event(None, b"[DONE]")
    assert m.done and m.usage().model_dump() == {"input_tokens": 40, "cached_tokens": 60, "cache_write_tokens": 0,
                                                 "output_tokens": 7}


def test_error_event_before_content():
    m = StreamMeter(MESSAGES)
    m.on_event(b"message_start", json.dumps({"type": "message_start", "message": {"usage": {"input_tokens": 5}}}).encode())
    m.on_event(b"error", b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}')
    assert m.error_before_content and not m.meaningful


def test_normalise_litellm_mapping_of_anthropic_usage():
    # LiteLLM's OpenAI-format usage for 1,200 input / 300 cache-write / 40,000 cache-read / 60 output
    raw = {"prompt_tokens": 41500, "completion_tokens": 60,
           "prompt_tokens_details": {"cached_tokens": 40000, "cache_creation_tokens": 300},
           "cache_read_input_tokens": 40000, "cache_creation_input_tokens": 300}
    assert normalise(CHAT, raw).model_dump() == {"input_tokens": 1200, "cached_tokens": 40000,
                                                 "cache_write_tokens": 300, "output_tokens": 60}
    assert normalise(MESSAGES, {"input_tokens": 3, "cache_read_input_tokens": None}).input_tokens == 3
    assert normalise(CHAT, None).model_dump() == {"input_tokens": 0, "cached_tokens": 0, "cache_write_tokens": 0,
                                                  "output_tokens": 0}


def test_retry_classification():
    assert retryable_status(429, b'{"error":{"type":"rate_limit_error"}}')
    assert not retryable_status(429, b'{"error":{"details":{"error_code":"enforced_spend_limit_reached"}}}')
    assert not retryable_status(429, b'{"error":{"code":"insufficient_quota"}}')
    assert retryable_status(529, b"") and retryable_status(503, b"")
    assert retryable_status(500, b'{"error":{"message":"litellm.InternalServerError: ... overloaded_error"}}')
    assert not retryable_status(500, b'{"error":{"message":"boom"}}')
    for status in (400, 401, 403, 404):
        assert not retryable_status(status, b"")


def test_retry_after():
    assert retry_after_s({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after_s({"retry-after": "7"}) == 7
    assert retry_after_s({"llm_provider-retry-after": "3"}) == 3
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0
    assert retry_after_s({}) is None
    assert retry_after_s(CIMultiDict({"Retry-After": "2"})) == 2  # upstream header case varies
    b = Backoff(base_s=1, cap_s=30, max_retry_after_s=60)
    assert 7 <= b.delay(1, {"retry-after": "7"}) <= 7.25
    assert b.delay(1, {"retry-after": "600"}) <= 60.25
    assert all(0 <= b.delay(n) <= min(30, 2 ** (n - 1)) for n in range(1, 12))


def test_rate_limit_headers_strip_litellm_prefix():
    from shim.progress import rate_limit_headers

    got = rate_limit_headers({
        "llm_provider-anthropic-ratelimit-input-tokens-limit": "80000",
        "x-ratelimit-limit-requests": "50",
        "llm_provider-x-ratelimit-limit-requests": "49",
        "x-litellm-response-cost": "0.1",
        "content-type": "application/json",
    })
    assert got == {"anthropic-ratelimit-input-tokens-limit": "80000", "x-ratelimit-limit-requests": "50"}


def test_limit_discovery_reads_the_headers_at_most_once_a_minute_with_or_without_limits():
    """SessionProgress.discovered: a 429 forces it; otherwise the headers are read at most once a minute, also when
    they carry no limits (a gateway that sends none is not parsed on every call)."""
    from contract.models import AttemptRef
    from shim.progress import SessionProgress

    class Source:  # an upstream Response: .headers is parsed when read
        reads = 0

        def __init__(self, headers):
            self._headers = headers

        @property
        def headers(self):
            Source.reads += 1
            return self._headers

    p = SessionProgress(object(), AttemptRef(run="r", instance_id="repo__repo-1", attempt=1), "pool")
    assert p.discovered(Source({"content-type": "application/json"})) is None and Source.reads == 1
    assert p.discovered(Source({"x-ratelimit-limit-requests": "500"})) is None and Source.reads == 1  # not yet
    found = p.discovered(Source({"x-ratelimit-limit-requests": "500"}), force=True)  # a 429
    assert found["x-ratelimit-limit-requests"] == "500" and Source.reads == 2
