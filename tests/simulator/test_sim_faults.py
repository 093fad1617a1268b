"""Injected faults: error statuses with real bodies, SSE error events, cut streams, seeded dice."""

from __future__ import annotations

import anthropic
import openai
import pytest
from sim_http import ANTHROPIC, OPENAI, get_json, post

from simulator import SimulatorConfig
from simulator.testing import running_simulator

CHAT = {"model": "gpt-f", "messages": [{"role": "user", "content": "hello"}]}
MESSAGES = {"model": "claude-f", "max_tokens": 50, "messages": [{"role": "user", "content": "hello"}]}


def test_overload_is_529_on_anthropic_and_503_on_openai():
    with running_simulator(SimulatorConfig(error_rate=1.0, error_statuses=[529])) as url:
        a = post(f"{url}/v1/messages", MESSAGES, ANTHROPIC)
        o = post(f"{url}/v1/chat/completions", CHAT, OPENAI)
        stats = get_json(f"{url}/_sim/stats")["models"]
    assert a.status == 529
    assert {k: v for k, v in a.json().items() if k != "request_id"} == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert o.status == 503 and o.json()["error"]["type"] == "server_error"
    assert stats["claude-f"]["errors"] == {"529": 1} and stats["gpt-f"]["errors"] == {"503": 1}
    assert stats["claude-f"]["input_tokens"] == 0  # nothing billed for a refused call


def test_injected_429_carries_retry_after():
    with running_simulator(SimulatorConfig(error_rate=1.0, error_statuses="429")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(**CHAT)
        a = post(f"{url}/v1/messages", MESSAGES, ANTHROPIC)
    assert (
        e.value.response.headers["retry-after"] == "1"
        and e.value.response.headers["retry-after-ms"] == "1000"
    )
    assert e.value.code == "rate_limit_exceeded"
    assert (
        a.status == 429
        and a.headers["retry-after"] == "1"
        and a.json()["error"]["type"] == "rate_limit_error"
    )


def test_stream_error_event_before_any_content():
    with running_simulator(SimulatorConfig(stream_error_rate=1.0)) as url:
        raw = post(f"{url}/v1/messages", {**MESSAGES, "stream": True}, ANTHROPIC)
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as e, client.messages.stream(**MESSAGES) as s:
            list(s.text_stream)
        with pytest.raises(openai.APIError) as o:
            list(
                openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0).chat.completions.create(
                    **CHAT, stream=True
                )
            )
        stats = get_json(f"{url}/_sim/stats")["models"]
    assert raw.status == 200
    assert raw.events() == [
        ("error", '{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}')
    ]
    assert e.value.body["error"]["type"] == "overloaded_error"
    assert o.value.body["type"] == "overloaded_error"
    assert stats["claude-f"]["stream_errors"] == 2 and stats["gpt-f"]["stream_errors"] == 1


def test_cut_stream_closes_the_connection_half_way():
    with running_simulator(SimulatorConfig(stream_cut_rate=1.0)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        received = []
        with pytest.raises(openai.APIConnectionError):
            received.extend(client.chat.completions.create(**CHAT, stream=True))
        stats = get_json(f"{url}/_sim/stats")["models"]["gpt-f"]
    text = "".join(c.choices[0].delta.content or "" for c in received)
    assert 0 < len(text) < len("Hello from the evalplane simulator.")
    assert not any(c.choices[0].finish_reason for c in received)
    assert stats["stream_cuts"] == 1 and 0 < stats["output_tokens"] < 9  # billed for what was sent


def test_seed_makes_the_faults_reproducible():
    def statuses(seed: int) -> list[int]:
        config = SimulatorConfig(error_rate=0.5, error_statuses=[429, 503], seed=seed)
        with running_simulator(config) as url:
            return [post(f"{url}/v1/chat/completions", CHAT, OPENAI).status for _ in range(16)]

    first = statuses(7)
    assert first == statuses(7)
    assert {200, 429, 503} <= set(first + statuses(8))
