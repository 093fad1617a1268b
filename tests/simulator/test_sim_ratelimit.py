"""Rate limits: bucket arithmetic, header formats, headers counting down, and 429s on both routes."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from sim_http import ANTHROPIC, OPENAI, get_json, post

from simulator import SimulatorConfig
from simulator.ratelimit import Limits, go_duration
from simulator.testing import running_simulator
from simulator.tokens import estimate

GO_DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.012, "12ms"), (1, "1s"), (2.081, "2.081s"), (360, "6m0s"), (3661.5, "1h1m1.5s")],
)
def test_go_durations(seconds, text):
    assert go_duration(seconds) == text


def test_buckets_refill_continuously_with_one_minute_of_burst():
    now = [0.0]
    limits = Limits({"requests": 60, "tokens": 600, "off": 0}, clock=lambda: now[0])
    assert limits.admit({"requests": 60, "tokens": 100}) is None  # the whole minute at once
    refusal = limits.admit({"requests": 1, "tokens": 1})
    assert (
        refusal is not None and refusal.dimension == "requests" and refusal.retry_after_s == pytest.approx(1)
    )
    now[0] = 1.0
    assert limits.admit({"requests": 1, "tokens": 1, "off": 10**9}) is None  # refilled one request per second
    state = limits.snapshot()
    assert set(state) == {"requests", "tokens"}  # a limit of 0 is no limit and has no headers
    assert state["tokens"].remaining == 509 and state["requests"].remaining == 0
    assert state["tokens"].reset_s == pytest.approx(91 / 10)


def test_openai_headers_count_down_then_429(topic):
    body = {"model": "gpt-rl", "messages": [{"role": "user", "content": topic}], "max_tokens": 50}
    with running_simulator(SimulatorConfig(rpm=3, tpm=10_000)) as url:
        answers = [post(f"{url}/v1/chat/completions", body, OPENAI) for _ in range(4)]
        stats = get_json(f"{url}/_sim/stats")["models"]["gpt-rl"]
    assert [a.status for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0", "0"]
    assert all(a.headers["x-ratelimit-limit-requests"] == "3" for a in answers)
    assert all(a.headers["x-ratelimit-limit-tokens"] == "10000" for a in answers)
    cost = estimate(body["messages"][0]) + 50  # prompt + max_tokens
    assert int(answers[0].headers["x-ratelimit-remaining-tokens"]) == 10_000 - cost
    assert all(GO_DURATION.match(a.headers["x-ratelimit-reset-tokens"]) for a in answers)
    refused = answers[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= 20 and int(refused.headers["retry-after-ms"]) > 0
    assert (
        refused.json()["error"]["type"] == "requests"
        and refused.json()["error"]["code"] == "rate_limit_exceeded"
    )
    assert stats["requests"] == 4 and stats["errors"] == {"429": 1}


def test_openai_token_limit_counts_max_tokens(topic):
    with running_simulator(SimulatorConfig(tpm=1_000)) as url:
        r = post(
            f"{url}/v1/chat/completions",
            {"model": "gpt-rl", "messages": [{"role": "user", "content": topic}], "max_tokens": 990},
            OPENAI,
        )
    assert r.status == 429 and r.json()["error"]["type"] == "tokens"
    assert r.headers["x-ratelimit-remaining-tokens"] == "1000"  # nothing was charged


def test_anthropic_headers_and_429(topic):
    body = {"model": "claude-rl", "max_tokens": 100, "messages": [{"role": "user", "content": topic}]}
    with running_simulator(SimulatorConfig(rpm=2, itpm=5_000, otpm=1_000)) as url:
        answers = [post(f"{url}/v1/messages", body, ANTHROPIC) for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 429]
    first = answers[0].headers
    assert (
        first["anthropic-ratelimit-requests-limit"] == "2"
        and first["anthropic-ratelimit-requests-remaining"] == "1"
    )
    assert answers[1].headers["anthropic-ratelimit-requests-remaining"] == "0"
    used_in, used_out = (
        int(answers[0].json()["usage"]["input_tokens"]),
        answers[0].json()["usage"]["output_tokens"],
    )
    assert int(first["anthropic-ratelimit-input-tokens-remaining"]) == 5_000 - used_in
    assert int(first["anthropic-ratelimit-output-tokens-remaining"]) == 1_000 - used_out
    assert first["anthropic-ratelimit-tokens-limit"] == "6000"  # combined input + output
    reset = datetime.strptime(first["anthropic-ratelimit-requests-reset"], "%Y-%m-%dT%H:%M:%S%z")
    assert 0 < (reset - datetime.now(UTC)).total_seconds() <= 31
    assert int(answers[2].headers["retry-after"]) >= 1
    assert answers[2].json()["error"]["type"] == "rate_limit_error"


def test_anthropic_cache_reads_do_not_count_toward_itpm(topic):
    system = [{"type": "text", "text": "x" * 4_000, "cache_control": {"type": "ephemeral"}}]  # 1,000+ tokens
    first = [{"role": "user", "content": topic}]
    more = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    with running_simulator(SimulatorConfig(itpm=1_100)) as url:
        r1 = post(
            f"{url}/v1/messages",
            {"model": "c", "max_tokens": 10, "system": system, "messages": first},
            ANTHROPIC,
        )
        r2 = post(
            f"{url}/v1/messages",
            {"model": "c", "max_tokens": 10, "system": system, "messages": more},
            ANTHROPIC,
        )
        fresh = [{"role": "user", "content": topic + " again"}]
        r3 = post(
            f"{url}/v1/messages",
            {"model": "c", "max_tokens": 10, "system": system, "messages": fresh},
            ANTHROPIC,
        )
    assert r1.status == 200 and r2.status == 200
    assert r2.json()["usage"]["cache_read_input_tokens"] > 1_000  # more than the whole remaining budget
    assert r3.status == 429 and "input tokens" in r3.json()["error"]["message"]


def test_limits_resized_mid_run_keep_their_level_up_to_the_new_size():
    now = [0.0]
    limits = Limits({"requests": 60, "tokens": 600}, clock=lambda: now[0])
    assert limits.admit({"requests": 10, "tokens": 100}) is None
    limits.resize({"requests": 30, "tokens": 1200})
    state = limits.snapshot()
    assert state["requests"].limit == 30 and state["requests"].remaining == 30  # 50 held, clipped to the new size
    assert state["tokens"].limit == 1200 and state["tokens"].remaining == 500  # what it held, room to refill
    now[0] = 6.0
    assert limits.snapshot()["tokens"].remaining == 620  # refilling at the new rate: 20 a second
