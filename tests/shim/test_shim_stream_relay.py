"""The stream relay (shim/stream.py) at its edges: a harness that reads slowly (the shim stops reading upstream
instead of buffering), and an upstream that stalls before or after the first content event."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from aiohttp import web
from shimtest import ANTHROPIC_OK, LOCAL_TOKEN, anthropic_stream, sse

from simulator.testing import running_app

STREAM = {"model": "m", "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "go"}]}
SSE_HEADERS = {"content-type": "text/event-stream"}


def _preamble() -> bytes:
    start = {**ANTHROPIC_OK, "content": [], "stop_reason": None,
             "usage": {**ANTHROPIC_OK["usage"], "input_tokens": 11, "output_tokens": 1}}
    return (sse("message_start", {"type": "message_start", "message": start})
            + sse("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}))


def _delta(text: str) -> bytes:
    return sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": text}})


_END = (sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        + sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                "usage": {"output_tokens": 7}})
        + sse("message_stop", {"type": "message_stop"}))


@contextmanager
def upstream(handlers):
    """An upstream whose n-th request is answered by handlers[min(n, len - 1)](response) (after prepare)."""
    count = [0]

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        i = min(count[0], len(handlers) - 1)
        count[0] += 1
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            await handlers[i](resp)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    with running_app(app) as url:
        yield url, count


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_slow_harness_holds_the_upstream_back_instead_of_filling_the_shim(shim):
    """48 MB of deltas as fast as the upstream can send them, to a harness that stops reading for 1.5 s: the
    shim stops reading upstream (its memory does not grow by the stream), then relays every byte in order."""
    n, text = 12_000, "x" * 4000
    sent = [0]

    async def big(resp: web.StreamResponse) -> None:
        await resp.write(_preamble())
        for i in range(n):
            await resp.write(_delta(f"{i:06d}{text}"))
            sent[0] = i + 1
        await resp.write(_END)

    with upstream([big]) as (url, _):
        s = shim(url)
        base_rss = _rss_mb(s.proc.pid)
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.base}/v1/messages", json=STREAM,
                                                      headers={"x-api-key": LOCAL_TOKEN}) as r:
            assert r.status_code == 200
            parts = r.iter_raw(65536)
            got = [next(parts)]
            time.sleep(1.5)  # the harness is busy; loopback buffers fill, then everything waits
            held_back_at = sent[0]
            grown = _rss_mb(s.proc.pid) - base_rss
            got += list(parts)
        body = b"".join(got)
    assert held_back_at < n / 2, held_back_at  # the upstream was held back while the harness did not read
    assert grown < 20, grown  # not 48 MB buffered in the shim
    ids = [int(chunk[:6]) for chunk in body.split(b'"text_delta", "text": "')[1:]]
    assert ids == list(range(n)) and body.rstrip().endswith(b'{"type": "message_stop"}')
    (row,) = s.rows()
    assert row["outcome"] == "ok" and row["output_tokens"] == 7 and row["usage_estimated"] is False


def test_an_upstream_stalled_after_content_is_cut_metered_and_reported(shim):
    async def stall(resp: web.StreamResponse) -> None:
        await resp.write(_preamble() + _delta("partial answer"))
        await asyncio.sleep(5)

    with upstream([stall]) as (url, count):
        s = shim(url, sock_read_timeout_s=0.5)
        t0 = time.monotonic()
        r = httpx.post(f"{s.base}/v1/messages", json=STREAM, headers={"x-api-key": LOCAL_TOKEN}, timeout=30)
        took = time.monotonic() - t0
    assert r.status_code == 200 and took < 3
    assert b"partial answer" in r.content
    assert b"event: error" in r.content and b"TimeoutError" in r.content  # the SDKs raise on it
    (row,) = s.rows()
    assert row["outcome"] == "stream_error" and row["usage_estimated"] is True and row["input_tokens"] == 11
    assert count[0] == 1  # committed: not retried


def test_an_upstream_stalled_before_content_is_retried_unseen(shim):
    async def stall(resp: web.StreamResponse) -> None:
        await resp.write(_preamble())
        await asyncio.sleep(5)

    async def fine(resp: web.StreamResponse) -> None:
        await resp.write(anthropic_stream("all good", input_tokens=11, output_tokens=3))

    with upstream([stall, fine]) as (url, count):
        s = shim(url, sock_read_timeout_s=0.5)
        r = httpx.post(f"{s.base}/v1/messages", json=STREAM, headers={"x-api-key": LOCAL_TOKEN}, timeout=30)
    assert r.status_code == 200 and b"all good" in r.content and b"event: error" not in r.content
    assert r.content.count(b"event: message_start") == 1  # the stalled attempt's preamble never reached the harness
    (row,) = s.rows()
    assert row["outcome"] == "ok" and row["retries"] == 1 and count[0] == 2
    # the stalled attempt may have been billed for its prompt: metered, and marked estimated
    assert row["usage_estimated"] is True and row["input_tokens"] == 22


def test_the_head_goes_at_once_and_the_events_wait_for_content(shim):
    """The harness's time to first byte is the provider's: the head (200, event-stream) goes as soon as the
    upstream's is in, while the preamble events wait for the first content event."""
    async def slow(resp: web.StreamResponse) -> None:
        await resp.write(_preamble())
        await asyncio.sleep(1.0)
        await resp.write(_delta("late") + _END)

    with upstream([slow]) as (url, _):
        s = shim(url)
        t0 = time.monotonic()
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{s.base}/v1/messages", json=STREAM,
                                                      headers={"x-api-key": LOCAL_TOKEN}) as r:
            head_at = time.monotonic() - t0
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            parts = r.iter_raw()
            first = next(parts)
            first_at = time.monotonic() - t0
            body = first + b"".join(parts)
    assert head_at < 0.6 and first_at >= 0.9, (head_at, first_at)  # events only with the content
    assert first.startswith(b"event: message_start") and b"late" in first  # the preamble came with it
    assert body.rstrip().endswith(b'{"type": "message_stop"}')
    (row,) = s.rows()
    assert row["outcome"] == "ok" and row["http_status"] == 200 and row["output_tokens"] == 7


def test_a_stream_whose_retries_all_fail_before_content_ends_with_the_error_event(shim):
    """Every attempt fails before content (an overloaded error event): the harness already has the 200 head,
    so the end comes as an error event (the SDKs raise on it) saying rate_limited; no attempt's events leak,
    and the session has ended."""
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}

    async def fail(resp: web.StreamResponse) -> None:
        await resp.write(_preamble() + sse("error", overloaded))

    with upstream([fail]) as (url, count):
        s = shim(url, max_attempts=3, backoff_base_s=0.01)
        with httpx.Client(timeout=30) as c:
            r = c.post(f"{s.base}/v1/messages", json=STREAM, headers={"x-api-key": LOCAL_TOKEN})
        with pytest.raises(anthropic.BadRequestError, match="rate_limited"), s.anthropic().messages.stream(
                model="m", max_tokens=100, messages=[{"role": "user", "content": "go"}]) as st:
            st.get_final_text()
    assert r.status_code == 200 and b"message_start" not in r.content
    assert r.content.count(b"event: error") == 1 and b"rate_limited" in r.content and b"Overloaded" in r.content
    assert count[0] == 3  # the first call's three attempts; the second was refused
    rows = s.rows()
    assert [(r["outcome"], r["http_status"], r["retries"]) for r in rows] == [("rate_limited", 529, 2),
                                                                               ("rate_limited", 400, 0)]


def test_a_chat_stream_whose_retries_all_fail_ends_with_an_error_chunk(shim):
    """The same on the OpenAI route: the end comes as an error chunk, and the OpenAI SDK raises on it."""
    overloaded = {"error": {"message": "Overloaded", "type": "server_error", "code": "overloaded"}}

    async def fail(resp: web.StreamResponse) -> None:
        await resp.write(b"data: " + json.dumps(overloaded).encode() + b"\n\n")

    with upstream([fail]) as (url, count):
        s = shim(url, provider="openai", max_attempts=2, backoff_base_s=0.01)
        with pytest.raises(openai.APIError, match="rate_limited.*Overloaded"):
            list(s.openai().chat.completions.create(model="m", stream=True,
                                                    messages=[{"role": "user", "content": "go"}]))
    assert count[0] == 2
    (row,) = s.rows()
    assert (row["outcome"], row["http_status"], row["retries"]) == ("rate_limited", 529, 1)


def test_a_stream_answered_in_full_is_ok_when_the_shim_stops_during_its_tail(shim):
    """The harness has the final event and exits (its own cap reached); the upstream (a gateway finishing its
    bookkeeping) has not closed the stream yet when the task stops the shim: the call was answered in full."""
    stopped = threading.Event()

    async def linger(resp: web.StreamResponse) -> None:
        await resp.write(_preamble() + _delta("the whole answer") + _END)
        while not stopped.is_set():
            await asyncio.sleep(0.05)

    with upstream([linger]) as (url, _):
        s = shim(url, shutdown_timeout_s=0.5)
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{s.base}/v1/messages", json=STREAM,
                                                      headers={"x-api-key": LOCAL_TOKEN}) as r:
            body = b""
            for part in r.iter_raw():
                body += part
                if b"message_stop" in body:
                    break
        assert s.status()["in_flight"] == 1  # still reading the upstream's tail for the meter
        assert s.stop() == 0
        stopped.set()
    (row,) = s.rows()
    assert row["outcome"] == "ok" and row["http_status"] == 200, row
    assert row["output_tokens"] == 7 and row["usage_estimated"] is False
