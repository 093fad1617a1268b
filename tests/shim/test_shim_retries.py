"""Retries: the harness never sees 429/529/503/overloaded (when retries run out, the session ends as
rate_limited); terminal errors pass through marked final."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from shimtest import (
    LITELLM_OVERLOADED_500,
    LOCAL_TOKEN,
    UPSTREAM_KEY,
    anthropic_stream,
    running_stub,
    sim_stats,
    sse,
)

from contract import keys
from contract.models import AttemptRef

MODEL = "claude-sonnet-4-5"
SSE = {"content-type": "text/event-stream"}
BODY = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}


def test_injected_errors_are_absorbed(sim, shim, unique):
    url = sim(error_rate=0.3, error_statuses=[429, 529, 503], stream_error_rate=0.2, seed=11)
    s = shim(url, max_attempts=10)
    a, o = s.anthropic(), s.openai()
    n = 0
    for i in range(10):
        topic = f"{unique} case {i}"
        msg = a.messages.create(model="harness-model", max_tokens=100, messages=[{"role": "user", "content": topic}])
        assert msg.content[0].text
        with a.messages.stream(model="harness-model", max_tokens=100, messages=[{"role": "user", "content": topic}]) as st:
            assert st.get_final_text()
        r = o.chat.completions.create(model="harness-model", messages=[{"role": "user", "content": topic}])
        assert r.choices[0].message.content
        chunks = list(o.chat.completions.create(model="harness-model", messages=[{"role": "user", "content": topic}],
                                                stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert o.responses.create(model="harness-model", input=topic).output_text
        events = list(o.responses.create(model="harness-model", input=topic, stream=True))
        assert events[-1].type == "response.completed" and events[-1].response.output_text
        assert not [e for e in events if e.type == "error"]
        n += 6
    rows = s.rows()
    assert len(rows) == n
    assert all(r["outcome"] == "ok" and r["http_status"] == 200 for r in rows)
    truth = sim_stats(url, MODEL)
    injected = sum(truth["errors"].values()) + truth["stream_errors"]
    assert injected >= 5  # the dice did roll
    assert sum(r["retries"] for r in rows) == injected
    assert truth["requests"] == n + injected
    assert s.status()["retries"] == injected
    # what was billed (only successful attempts) is what the ledger says
    for f in ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens"):
        assert sum(r[f] for r in rows) == truth[f], f


def test_litellm_overloaded_500_and_stream_error_event_retried(shim):
    script = [
        (500, {"llm_provider-retry-after": "0"}, LITELLM_OVERLOADED_500),
        (200, SSE, sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})),
        (529, {"retry-after": "0"}, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        (200, SSE, anthropic_stream("hello world", input_tokens=17, output_tokens=3)),
    ]
    with running_stub(script) as (url, seen):
        s = shim(url)
        with s.anthropic().messages.stream(model="harness-model", max_tokens=50,
                                           messages=[{"role": "user", "content": "hi"}]) as st:
            assert st.get_final_text() == "hello world"
        assert len(seen) == 4
        for path, headers, body in seen:  # the real key and the pinned model went upstream, every time
            assert path == "/v1/messages" and headers["x-api-key"] == UPSTREAM_KEY and body["model"] == MODEL
            assert LOCAL_TOKEN not in json.dumps(headers)
    (row,) = s.rows()
    assert row["outcome"] == "ok" and row["retries"] == 3 and row["stream"] is True
    assert (row["input_tokens"], row["output_tokens"]) == (17, 3)


def test_terminal_errors_pass_through(shim):
    spend = {"type": "error", "error": {"type": "rate_limit_error", "message": "spend limit",
                                        "details": {"error_code": "enforced_spend_limit_reached"}}}
    with running_stub([(429, {}, spend)]) as (url, seen):
        s = shim(url)
        with pytest.raises(anthropic.RateLimitError) as e:
            s.anthropic().messages.create(**{**BODY, "model": "harness-model"})
        assert e.value.response.headers["x-should-retry"] == "false"
        assert len(seen) == 1
    with running_stub([(500, {}, {"error": {"message": "boom", "type": "api_error"}})]) as (url, seen):
        s2 = shim(url)
        with pytest.raises(anthropic.InternalServerError) as e:
            s2.anthropic().messages.create(**{**BODY, "model": "harness-model"})
        assert e.value.response.headers["x-should-retry"] == "false" and len(seen) == 1
    assert s.rows()[0]["outcome"] == "error" and s.rows()[0]["http_status"] == 429
    assert s2.rows()[0]["outcome"] == "error" and s2.rows()[0]["retries"] == 0


def test_retries_exhausted_end_the_session_as_rate_limited(shim, valkey, unique):
    """Never an overload to the harness: the last retry's failure becomes a 400 that no SDK retries (its SDK
    retries are on here), saying rate_limited, and the session ends: later calls are refused at once."""
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with running_stub([(529, {"retry-after": "0"}, overloaded)]) as (url, seen):
        s = shim(url, max_attempts=3)
        client = anthropic.Anthropic(base_url=s.base, api_key=LOCAL_TOKEN, max_retries=2)
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**{**BODY, "model": "harness-model"})
        assert e.value.status_code == 400 and e.value.response.headers["x-should-retry"] == "false"
        message = e.value.body["error"]["message"]
        assert message.startswith("rate_limited:") and "Overloaded" in message, message
        assert len(seen) == 3  # the shim's three attempts; the SDK did not retry
        r = httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=BODY)
        assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
        assert r.json()["error"]["message"].startswith("rate_limited:")
        assert len(seen) == 3  # refused without going upstream
        assert s.status()["stopped"] == "rate_limited"
    rows = s.rows()
    assert [(r["outcome"], r["retries"], r["http_status"]) for r in rows] == [("rate_limited", 2, 529),
                                                                               ("rate_limited", 0, 400)]
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    assert valkey.hget(keys.progress(ref), "stopped") == b"rate_limited"
    assert s.stop() == 0
    assert json.loads((s.dir / "status.json").read_text())["stopped"] == "rate_limited"


def test_unreachable_upstream_exhausted(shim):
    s = shim("http://127.0.0.1:9", max_attempts=2, provider="openai")  # nothing listens on the discard port
    with pytest.raises(openai.BadRequestError) as e:
        s.openai().chat.completions.create(model="harness-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and e.value.response.headers["x-should-retry"] == "false"
    assert e.value.code == "rate_limited" and "unreachable" in e.value.message
    (row,) = s.rows()
    assert (row["outcome"], row["retries"], row["http_status"]) == ("rate_limited", 1, 502)
    assert s.status()["stopped"] == "rate_limited"


def test_a_retry_that_would_pass_the_wall_time_ends_the_session_at_once(shim):
    """A 429 asking for 30 s when the attempt has 3 s left: no waiting it out, rate_limited at once."""
    limited = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    with running_stub([(429, {"retry-after": "30"}, limited)]) as (url, seen):
        s = shim(url, limits={"wall_time_s": 3}, max_retry_after_s=60)
        t0 = time.monotonic()
        r = httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json=BODY, timeout=30)
        took = time.monotonic() - t0
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false" and took < 2, (r.status_code, took)
    assert "wall time" in r.json()["error"]["message"] and len(seen) == 1
    (row,) = s.rows()
    assert (row["outcome"], row["retries"], row["http_status"]) == ("rate_limited", 0, 429)
    assert s.status()["stopped"] == "rate_limited"


@pytest.mark.parametrize("route", ["anthropic", "openai"])
def test_cut_stream_is_metered_as_estimated(sim, shim, unique, route):
    url = sim(stream_cut_rate=1.0, tokens_per_s=1000)  # paced, so content reaches the harness before the cut
    s = shim(url)
    text = f"{unique} please write a long answer " * 5
    if route == "anthropic":
        with pytest.raises(anthropic.APIError), s.anthropic().messages.stream(
                model="harness-model", max_tokens=500, messages=[{"role": "user", "content": text}]) as st:
            st.get_final_text()
    else:
        with pytest.raises(openai.APIError):
            list(s.openai().chat.completions.create(model="harness-model", stream=True,
                                                    messages=[{"role": "user", "content": text}]))
    (row,) = s.rows()
    truth = sim_stats(url, MODEL)
    # a cut that lands before any content reached the shim is retried transparently (rare, under load)
    attempts = row["retries"] + 1
    assert truth["stream_cuts"] == attempts
    assert row["outcome"] == "stream_error" and row["usage_estimated"] is True and row["http_status"] == 200
    assert row["output_tokens"] > 0
    assert row["output_tokens"] <= truth["output_tokens"] * 2 + 4
    if attempts == 1:
        assert truth["output_tokens"] / 2 <= row["output_tokens"]
    prompt = row["input_tokens"] + row["cached_tokens"] + row["cache_write_tokens"]
    truth_prompt = truth["input_tokens"] + truth["cached_tokens"] + truth["cache_write_tokens"]
    if route == "anthropic":
        assert prompt == truth_prompt  # message_start carried the input usage (of every attempt, all metered)
    else:
        assert truth_prompt <= prompt <= truth_prompt * 3  # estimated from the request size, every attempt
    assert row["cost_usd"] > 0


def test_a_call_being_retried_shows_as_failing_in_the_status(shim):
    """While a call waits out a refusal the shim's status counts it as failing (the task's wall-time guard reads it:
    an attempt whose time ran out there lands infra_error/rate_limited, harness/task.py); once answered, it does not."""
    import threading

    limited = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    script = [(429, {"retry-after": "2"}, limited),
              (200, SSE, anthropic_stream("hello", input_tokens=5, output_tokens=1))]
    with running_stub(script) as (url, seen):
        s = shim(url, max_retry_after_s=60)
        assert s.status()["failing"] == 0
        answer = {}
        t = threading.Thread(target=lambda: answer.setdefault("r", httpx.post(
            f"{s.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN}, json={**BODY, "stream": True}, timeout=30)))
        t.start()
        deadline = time.monotonic() + 1.5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert s.status()["failing"] == 1  # in its retry's wait
        t.join(30)
    assert answer["r"].status_code == 200 and len(seen) == 2
    assert s.status()["failing"] == 0


@pytest.mark.parametrize("kept", [True, False], ids=["replayed", "not-kept"])
def test_an_answer_cut_after_its_head_is_replayed_or_else_estimated(shim, kept):
    """A non-stream answer cut after its head was billed. The retry names the attempts before it: a gateway that kept
    the answer replays it under the cut attempt's call id, and the call is metered once, from the answer; one that
    did not answers anew, and the cut attempt is metered as estimated beside it."""
    from aiohttp import web

    from simulator.testing import running_app

    answer = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "stop_reason": "end_turn",
              "content": [{"type": "text", "text": "fixed"}], "usage": {"input_tokens": 21, "output_tokens": 4}}
    seen: list[dict] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        attempt = request.headers["x-litellm-call-id"]
        if len(seen) == 1:  # its head goes out, then the connection drops mid-body (the replica died)
            resp = web.StreamResponse(status=200, headers={"content-type": "application/json",
                                                           "content-length": "400", "x-litellm-call-id": attempt})
            await resp.prepare(request)
            await resp.write(b'{"id": "msg_1", ')
            request.transport.close()
            return resp
        replayed = request.headers["x-evalplane-replay-of"].split(",")
        return web.json_response(answer, headers={"x-litellm-call-id": replayed[0] if kept else attempt})

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    with running_app(app) as url:
        s = shim(url)
        msg = s.anthropic().messages.create(model="harness-model", max_tokens=50,
                                            messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == "fixed"
    first, second = (h["x-litellm-call-id"] for h in seen)
    call = first.rpartition(":")[0]
    assert (first, second) == (f"{call}:1", f"{call}:2") and "x-evalplane-replay-of" not in seen[0]
    assert seen[1]["x-evalplane-replay-of"] == first
    (row,) = s.rows()
    assert row["call_id"] == call and row["retries"] == 1 and row["outcome"] == "ok"
    if kept:
        assert row["gateway_call_id"] == first and row["usage_estimated"] is False
        assert (row["input_tokens"], row["output_tokens"]) == (21, 4)
        assert "evalplane_prior_attempts" not in row["raw_usage"]
    else:
        assert row["gateway_call_id"] == second and row["usage_estimated"] is True
        assert row["input_tokens"] > 21 and row["output_tokens"] == 4 + 50  # the cut attempt: its max_tokens
        assert row["raw_usage"]["evalplane_prior_attempts"] == [None]
