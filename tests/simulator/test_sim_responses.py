"""The official openai SDK against the simulator's Responses API: items, usage with cached tokens, the stream's
event sequence, 400s and rate-limit headers."""

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


def test_answer_usage_and_cache(client, topic):
    first = [{"role": "user", "content": topic}]
    r1 = client.responses.create(model="gpt-sim", instructions="Be terse. " * 20, input=first)
    assert r1.object == "response" and r1.id.startswith("resp_") and r1.status == "completed"
    assert r1.output_text == ECHO_TEXT and [o.type for o in r1.output] == ["message"]
    assert r1.usage.input_tokens == estimate({"instructions": "Be terse. " * 20}) + estimate(first[0])
    assert r1.usage.output_tokens == OUTPUT_TOKENS and r1.usage.input_tokens_details.cached_tokens == 0
    second = [*first, *(o.model_dump(exclude_none=True) for o in r1.output), {"role": "user", "content": "Then?"}]
    r2 = client.responses.create(model="gpt-sim", instructions="Be terse. " * 20, input=second)
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens  # input_tokens include them
    assert r2.usage.total_tokens == r2.usage.input_tokens + r2.usage.output_tokens


def test_stream_events_and_usage(client, topic):
    events = list(client.responses.create(model="gpt-sim", input=topic, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ECHO_TEXT
    assert events[-1].response.usage.output_tokens == OUTPUT_TOKENS
    assert events[-1].response.usage.input_tokens == estimate({"role": "user", "content": topic})


def test_bad_requests_and_headers(url, topic):
    r = post(f"{url}/v1/responses", {"model": "gpt-sim", "input": topic}, OPENAI)
    assert r.status == 200 and int(r.headers["x-ratelimit-limit-requests"]) > 0
    missing = post(f"{url}/v1/responses", {"model": "gpt-sim"}, OPENAI)
    assert missing.status == 400 and missing.json()["error"]["message"].startswith("input:")
    chained = post(f"{url}/v1/responses", {"model": "gpt-sim", "input": "x", "previous_response_id": "resp_1"}, OPENAI)
    assert chained.status == 400 and "previous_response_id" in chained.json()["error"]["message"]
    assert post(f"{url}/responses", {"model": "gpt-sim", "input": topic}, OPENAI).status == 200  # unversioned
    assert post(f"{url}/v1/responses", {"model": "gpt-sim", "input": topic}).status == 401


def test_injected_stream_error_is_an_error_event(topic):
    with running_simulator(SimulatorConfig(stream_error_rate=1.0)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
        (event,) = list(c.responses.create(model="gpt-sim", input=topic, stream=True))
    assert event.type == "error" and event.message == "Overloaded"
