"""The official anthropic SDK against the simulator: messages, the event stream, cache usage, auth."""

from __future__ import annotations

import json
import math

import anthropic
import pytest
from sim_http import ANTHROPIC, post

from simulator import SimulatorConfig
from simulator.policy import ECHO_TEXT
from simulator.testing import running_simulator
from simulator.tokens import estimate

OUTPUT_TOKENS = math.ceil(len(ECHO_TEXT) / 4)
SYSTEM = [
    {"type": "text", "text": "You are a careful engineer. " * 40, "cache_control": {"type": "ephemeral"}}
]


@pytest.fixture(scope="module")
def url():
    with running_simulator(SimulatorConfig()) as base:  # no --api-key: any non-empty key works
        yield base


@pytest.fixture
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="any-key", max_retries=0)


def test_message_and_usage(client, topic):
    messages = [{"role": "user", "content": topic}]
    r = client.messages.create(model="claude-sim", max_tokens=100, system="Be brief.", messages=messages)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ECHO_TEXT
    assert r.stop_reason == "end_turn"
    assert r.usage.input_tokens == estimate({"system": "Be brief."}) + estimate(messages[0])
    assert r.usage.cache_creation_input_tokens == 0 and r.usage.cache_read_input_tokens == 0
    assert r.usage.output_tokens == OUTPUT_TOKENS


def test_cache_write_then_cache_read(client, topic):
    first = [{"role": "user", "content": topic}]
    r1 = client.messages.create(model="claude-sim", max_tokens=100, system=SYSTEM, messages=first)
    preamble = estimate({"system": SYSTEM})
    assert r1.usage.cache_creation_input_tokens == preamble  # the marker sits on the system prompt
    assert r1.usage.input_tokens == estimate(first[0])  # after the marker: uncached
    assert r1.usage.cache_read_input_tokens == 0

    second = [*first, {"role": "assistant", "content": ECHO_TEXT}, {"role": "user", "content": "More?"}]
    r2 = client.messages.create(model="claude-sim", max_tokens=100, system=SYSTEM, messages=second)
    assert r2.usage.cache_read_input_tokens == preamble + estimate(first[0])
    assert r2.usage.cache_creation_input_tokens == 0  # nothing new before the marker
    assert r2.usage.input_tokens == estimate(second[1]) + estimate(second[2])


def test_stream_event_sequence_and_usage(client, url, topic):
    with client.messages.stream(
        model="claude-sim", max_tokens=100, messages=[{"role": "user", "content": topic}]
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == ECHO_TEXT and final.stop_reason == "end_turn"
    assert final.usage.input_tokens == estimate({"role": "user", "content": topic})
    assert final.usage.output_tokens == OUTPUT_TOKENS  # message_delta's cumulative count

    raw = post(
        f"{url}/v1/messages",
        {
            "model": "claude-sim",
            "max_tokens": 100,
            "stream": True,
            "messages": [{"role": "user", "content": topic + "!"}],
        },
        ANTHROPIC,
    )
    assert raw.status == 200 and raw.headers["content-type"] == "text/event-stream"
    names = [name for name, _ in raw.events()]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(json.loads(data)["type"] == name for name, data in raw.events())
    start = json.loads(raw.events()[0][1])["message"]["usage"]
    assert set(start) == {
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
    }


def test_auth_errors(url):
    r = post(f"{url}/v1/messages", {"model": "claude-sim", "max_tokens": 1, "messages": []})
    assert r.status == 401
    assert r.json()["error"] == {"type": "authentication_error", "message": "x-api-key header is required"}
    with running_simulator(SimulatorConfig(api_key="right")) as strict:
        bad = anthropic.Anthropic(base_url=strict, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(
                model="claude-sim", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        assert e.value.body["error"]["type"] == "authentication_error"
        good = anthropic.Anthropic(base_url=strict, api_key="right", max_retries=0)
        assert (
            good.messages.create(
                model="claude-sim", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
            .content[0]
            .text
            == ECHO_TEXT
        )


def test_malformed_requests_get_400(url):
    no_max = post(f"{url}/v1/messages", {"model": "claude-sim", "messages": []}, ANTHROPIC)
    assert no_max.status == 400
    assert no_max.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    broken = post(f"{url}/v1/messages", b"[1,", ANTHROPIC)
    assert broken.status == 400 and broken.json()["type"] == "error"
