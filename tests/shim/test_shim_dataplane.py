"""The compiled data plane (shim/dataplane, shim/front.py): calls on tickets go through it, the rest and every
retry through the Python shim, and the ledger is the same either way. (EVALPLANE_SHIM_DATAPLANE=compiled runs the
whole shim suite against it too.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from shimtest import (
    ANTHROPIC_OK,
    LITELLM_OVERLOADED_500,
    LOCAL_TOKEN,
    anthropic_stream,
    running_stub,
    sim_stats,
    sse,
)

from contract.models import CallRecord, Totals
from shim.front import binary

pytestmark = pytest.mark.skipif(binary() is None and not __import__("os").environ.get("CI"),
                                reason="no shim_dataplane binary (scripts/build_dataplane.sh)")


def _calls(s, provider: str, n: int) -> None:
    for i in range(n):
        stream = i % 2 == 1
        if provider == "anthropic":
            c = s.anthropic()
            msgs = [{"role": "user", "content": f"Fix bug {i}. " + "context " * (50 * i)}]
            if stream:
                with c.messages.stream(model="whatever", max_tokens=200, messages=msgs) as st:
                    assert st.get_final_text()
            else:
                assert c.messages.create(model="whatever", max_tokens=200, messages=msgs).content[0].text
        else:
            c = s.openai()
            msgs = [{"role": "user", "content": f"Explain {i}. " + "context " * (50 * i)}]
            if stream:
                chunks = list(c.chat.completions.create(model="whatever", messages=msgs, max_tokens=200, stream=True))
                assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                assert any(ch.usage for ch in chunks)  # include_usage injected by the data plane
            else:
                assert c.chat.completions.create(model="whatever", messages=msgs, max_tokens=200).choices


@pytest.mark.parametrize("provider,model", [("anthropic", "claude-sonnet-4-5"), ("openai", "gpt-4o-mini")])
def test_calls_on_tickets_go_through_the_data_plane(sim, shim, provider, model):
    url = sim()
    s = shim(url, provider=provider, model=model, dataplane="compiled")
    _calls(s, provider, 8)
    status = s.status()
    assert status["dataplane"] == "compiled"
    # every call went through the data plane: the first on a ticket made when it asked, the later ones on
    # tickets taken ahead
    assert status["dataplane_calls"] == 8
    assert status["tickets"]["used"] == 7
    rows = [CallRecord.model_validate(r) for r in s.rows()]
    assert [r.seq for r in rows] == list(range(1, 9))
    assert [r.stream for r in rows] == [False, True] * 4
    assert all(r.outcome == "ok" and r.http_status == 200 and not r.usage_estimated for r in rows)
    assert all(r.model == model and r.retries == 0 for r in rows)
    truth = sim_stats(url, model)
    total = Totals.of(rows)
    assert truth["requests"] == 8
    assert total.input_tokens + total.cached_tokens + total.cache_write_tokens == truth["input_tokens"] + truth.get(
        "cache_read_input_tokens", 0) + truth.get("cache_creation_input_tokens", 0)
    assert total.output_tokens == truth["output_tokens"]
    assert s.stop() == 0
    assert "[REDACTED]" not in s.log()


def _post(s, body: dict) -> httpx.Response:
    return httpx.post(f"{s.base}/v1/messages", json=body, headers={"x-api-key": LOCAL_TOKEN}, timeout=20)


def test_failed_attempts_are_handed_over_and_retried(shim):
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    overloaded = sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    script = [
        (200, {}, ANTHROPIC_OK),  # first call: on a ticket the data plane asked for
        (429, {"retry-after": "0"}, {"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}}),
        (200, {}, ANTHROPIC_OK),  # the handed-over retry of call 2
        (500, {}, LITELLM_OVERLOADED_500),
        (200, {}, ANTHROPIC_OK),  # call 3, retried
        (200, {"content-type": "text/event-stream"}, overloaded),  # call 4: a stream failing before content
        (200, {"content-type": "text/event-stream"}, anthropic_stream("fine")),
        (400, {}, {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}),  # call 5
    ]
    with running_stub(script) as (url, seen):
        s = shim(url, dataplane="compiled")
        assert _post(s, body).status_code == 200
        r = _post(s, body)
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "ok"
        assert _post(s, body).status_code == 200
        with httpx.stream("POST", f"{s.base}/v1/messages", json={**body, "stream": True},
                          headers={"x-api-key": LOCAL_TOKEN}, timeout=20) as st:
            assert st.status_code == 200
            text = b"".join(st.iter_bytes())
        assert b"fine" in text and b"overloaded" not in text and text.count(b"event: message_start") == 1
        r = _post(s, body)
        assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
        status = s.status()
        assert status["tickets"]["used"] == 4
        rows = s.rows()
    assert len(seen) == 8
    assert all(h.get("x-api-key") not in (None, LOCAL_TOKEN) for _, h, _ in seen)
    assert not any(k.lower().startswith("x-evalplane") for _, h, _ in seen for k in h)
    assert [r["retries"] for r in rows] == [0, 1, 1, 1, 0]
    assert [r["http_status"] for r in rows] == [200, 200, 200, 200, 400]
    assert [r["outcome"] for r in rows] == ["ok", "ok", "ok", "ok", "error"]
    assert rows[3]["stream"] and rows[3]["output_tokens"] == 3


def test_turn_cap_holds_with_lent_tickets(sim, shim):
    s = shim(sim(), dataplane="compiled", limits={"max_turns": 3})
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    codes = [_post(s, body).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 403, 403]
    rows = s.rows()
    assert [r["outcome"] for r in rows] == ["ok", "ok", "ok", "max_turns_exceeded", "max_turns_exceeded"]
    assert s.status()["tickets"]["used"] == 2


def test_harness_leaving_a_stream_on_a_ticket_is_metered(sim, shim):
    s = shim(sim(tokens_per_s=10), dataplane="compiled")  # the answer takes ~1 s
    body = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "a long story please " * 10}]}
    assert _post(s, body).status_code == 200  # on a ticket asked for; its bookkeeping takes the next one
    with httpx.stream("POST", f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN},
                      json={**body, "stream": True}, timeout=20) as r:
        got = b""
        for piece in r.iter_bytes():
            got += piece
            if b"content_block_delta" in got:
                break  # the harness goes away
    assert s.status()["tickets"]["used"] == 1
    rows = s.rows()
    assert len(rows) == 2
    assert rows[1]["stream"] and rows[1]["outcome"] == "stream_error" and rows[1]["usage_estimated"]
    assert rows[1]["input_tokens"] + rows[1]["cached_tokens"] > 0 and rows[1]["output_tokens"] > 0
    # it stopped reading when the harness left: the answer's end never came (~1 s), nor its usage
    assert rows[1]["latency_ms"] < 900 and rows[1]["raw_usage"]["output_tokens"] == 1


def test_status_counts_the_data_planes_calls_until_their_rows_are_written(sim, shim):
    """/_shim/status's in_flight covers the data plane's calls, whose `end` lines its Outbox batches (end_batch_s
    while calls overlap): once it reads 0, every answered call has its ledger row (what a harness's wrapper and
    shimtest.rows() rely on)."""
    s = shim(sim(tokens_per_s=20), dataplane="compiled", end_batch_s=0.3)  # answers take ~0.5 s
    body = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "tell me a story " * 10}]}
    assert _post(s, body).status_code == 200  # tickets are lent from here on
    codes: list[int] = []
    calls = [threading.Thread(target=lambda: codes.append(_post(s, body).status_code)) for _ in range(4)]
    for t in calls:
        t.start()
    time.sleep(0.2)
    during = s.status()
    assert during["dataplane_in_flight"] >= 1 and during["in_flight"] >= during["dataplane_in_flight"]
    for t in calls:
        t.join()
    assert codes == [200] * 4
    rows = s.rows()  # the ledger file, read the moment status says in_flight 0
    st = s.status()
    assert st["in_flight"] == 0 and st["dataplane_in_flight"] == 0
    assert len(rows) == 5
    assert st["dataplane_calls"] == 5 and st["ledger_rows"] == 5
