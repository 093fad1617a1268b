"""The official openai SDK against the simulator: bodies, streams, usage with caching, auth, 400s."""

from __future__ import annotations

import math

import openai
import pytest
from sim_http import OPENAI, post

from simulator import SimulatorConfig
from simulator.policy import ECHO_TEXT
from simulator.testing import running_simulator
from simulator.tokens import estimate

OUTPUT_TOKENS = math.ceil(len(ECHO_TEXT) / 4)


@pytest.fixture(scope="module")
def url():
    with running_simulator(SimulatorConfig(api_key="test-key")) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0)


def test_non_stream_answer_and_usage(client, topic):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": topic}]
    r = client.chat.completions.create(model="gpt-sim", messages=messages)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "gpt-sim"
    assert r.choices[0].message.content == ECHO_TEXT
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == sum(estimate(m) for m in messages)
    assert r.usage.completion_tokens == OUTPUT_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + OUTPUT_TOKENS
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_extended_conversation_reads_earlier_prompt_from_cache(client, topic):
    first = [{"role": "system", "content": "You are terse." * 20}, {"role": "user", "content": topic}]
    r1 = client.chat.completions.create(model="gpt-sim", messages=first)
    second = [*first, {"role": "assistant", "content": ECHO_TEXT}, {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model="gpt-sim", messages=second)
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens == sum(estimate(m) for m in second)  # includes the cached part
    other = [first[0], {"role": "user", "content": topic + " (edited)"}]
    r3 = client.chat.completions.create(model="gpt-sim", messages=other)
    assert r3.usage.prompt_tokens_details.cached_tokens == 0  # a different conversation


def test_stream_with_usage_chunk(client, topic):
    messages = [{"role": "user", "content": topic}]
    chunks = list(
        client.chat.completions.create(
            model="gpt-sim", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO_TEXT
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == estimate(messages[0])
    assert chunks[-1].usage.completion_tokens == OUTPUT_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(client, topic):
    chunks = list(
        client.chat.completions.create(
            model="gpt-sim", messages=[{"role": "user", "content": topic}], stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None and c.choices for c in chunks)


def test_unversioned_path_is_served(url, topic):
    client = openai.OpenAI(base_url=url, api_key="test-key", max_retries=0)
    r = client.chat.completions.create(model="gpt-sim", messages=[{"role": "user", "content": topic}])
    assert r.choices[0].message.content == ECHO_TEXT


def test_wrong_or_missing_key_gets_401(url):
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong-key-123", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="gpt-sim", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert e.value.body["type"] == "invalid_request_error"
    missing = post(f"{url}/v1/chat/completions", {"model": "gpt-sim", "messages": []})
    assert missing.status == 401 and "didn't provide an API key" in missing.json()["error"]["message"]


def test_malformed_requests_get_400(url):
    broken = post(f"{url}/v1/chat/completions", b"{not json", OPENAI)
    assert broken.status == 400
    assert broken.json()["error"]["type"] == "invalid_request_error"
    assert "parse the JSON body" in broken.json()["error"]["message"]
    no_model = post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, OPENAI)
    assert no_model.status == 400 and no_model.json()["error"]["message"].startswith("model:")
