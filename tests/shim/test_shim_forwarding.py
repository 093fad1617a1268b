"""Both SDKs through the shim, on the three wire formats, streaming and not: answers, ledger rows vs the
simulator's truth, progress."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
from shimtest import LOCAL_TOKEN, UPSTREAM_KEY, sim_stats

from contract import keys
from contract.models import AttemptRef, CallRecord, Totals
from contract.pricing import price

SYSTEM = [{"type": "text", "text": "You are a careful software engineer. " * 40, "cache_control": {"type": "ephemeral"}}]


def _anthropic_calls(client, topic: str) -> None:
    history = [{"role": "user", "content": f"Fix the bug in {topic}."}]
    msg = client.messages.create(model="whatever", max_tokens=300, system=SYSTEM, messages=history)
    assert msg.content[0].text
    assert msg.usage.cache_creation_input_tokens > 0  # the marker wrote the cache
    history += [{"role": "assistant", "content": msg.content[0].text}, {"role": "user", "content": "And then?"}]
    with client.messages.stream(model="whatever", max_tokens=300, system=SYSTEM, messages=history) as stream:
        text = stream.get_final_text()
        final = stream.get_final_message()
    assert text
    assert final.usage.cache_read_input_tokens > 0  # the second turn read it


def _openai_calls(client, topic: str) -> None:
    history = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": f"Explain {topic}."}]
    r = client.chat.completions.create(model="whatever", messages=history, max_tokens=200)
    assert r.choices[0].message.content
    history += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "More."}]
    chunks = list(client.chat.completions.create(model="whatever", messages=history, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].prompt_tokens_details.cached_tokens > 0  # injected include_usage


def _responses_calls(client, topic: str) -> None:
    """The Responses API (openai SDK's responses.create), as Codex CLI calls it: the whole conversation each turn."""
    instructions = "Be brief. " * 30
    r = client.responses.create(model="whatever", instructions=instructions, input=f"Explain {topic}.",
                                max_output_tokens=200)
    assert r.output_text and r.usage.input_tokens_details.cached_tokens == 0
    history = [{"role": "user", "content": f"Explain {topic}."}, *(o.model_dump(exclude_none=True) for o in r.output),
               {"role": "user", "content": "More."}]
    events = list(client.responses.create(model="whatever", instructions=instructions, input=history, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0  # the second turn read the first


@pytest.mark.parametrize("route,provider,model", [("messages", "anthropic", "claude-sonnet-4-5"),
                                                  ("chat", "openai", "gpt-4o-mini"),
                                                  ("responses", "openai", "gpt-4o-mini")])
def test_sdks_and_ledger_match_truth(sim, shim, valkey, unique, route, provider, model):
    url = sim()
    s = shim(url, provider=provider, model=model)
    calls = {"messages": _anthropic_calls, "chat": _openai_calls, "responses": _responses_calls}[route]
    calls(s.anthropic() if provider == "anthropic" else s.openai(), unique)

    rows = [CallRecord.model_validate(r) for r in s.rows()]
    assert [r.seq for r in rows] == [1, 2]
    assert [r.stream for r in rows] == [False, True]
    assert all(r.outcome == "ok" and r.http_status == 200 and not r.usage_estimated for r in rows)
    assert all(r.model == model and r.provider == provider and r.run == unique for r in rows)
    assert {r.route for r in rows} == {{"messages": "/v1/messages", "chat": "/v1/chat/completions",
                                        "responses": "/v1/responses"}[route]}

    truth = sim_stats(url, model)
    total = Totals.of(rows)
    assert truth["requests"] == 2
    for f in ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens"):
        assert getattr(total, f) == truth[f], f
    assert total.cached_tokens > 0
    if provider == "anthropic":
        assert total.cache_write_tokens > 0
    p = price(model)
    for r in rows:
        assert r.cost_usd == pytest.approx(p.cost(r.usage), rel=1e-9)
        assert r.raw_usage  # verbatim provider usage
    assert total.cost_usd > 0

    # live progress and limit discovery in Valkey
    ref = AttemptRef(run=unique, instance_id="repo__repo-1", attempt=1)
    deadline = time.monotonic() + 10  # the shim writes progress after the answer went out: on a loaded host, later
    while True:
        prog = {k.decode(): v.decode() for k, v in valkey.hgetall(keys.progress(ref)).items()}
        if int(prog.get("calls", 0)) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert int(prog["calls"]) == 2
    assert int(prog["tokens"]) == sum(r.input_tokens + r.cached_tokens + r.cache_write_tokens + r.output_tokens
                                      for r in rows)
    assert float(prog["cost_usd"]) == pytest.approx(total.cost_usd)
    assert prog["stopped"] == ""
    assert 0 < valkey.ttl(keys.progress(ref)) <= keys.PROGRESS_TTL_S
    discovered = {k.decode(): v.decode() for k, v in valkey.hgetall(keys.pool_discovered(f"{unique}-pool")).items()}
    wanted = "anthropic-ratelimit-input-tokens-limit" if provider == "anthropic" else "x-ratelimit-limit-requests"
    assert int(discovered[wanted]) > 0, discovered

    status = s.status()
    assert status["calls"] == 2 and status["ledger_rows"] == 2 and status["stopped"] is None
    assert status["totals"]["cost_usd"] == pytest.approx(total.cost_usd)

    assert s.stop() == 0
    final = json.loads((s.dir / "status.json").read_text())
    assert final["ledger_rows"] == 2 and final["ledger_sent"] == 0  # no queue configured
    # the real key never leaves the upstream request: not in logs, ledger, status
    for text in (s.log(), s.ledger_path.read_text(), json.dumps(final)):
        assert UPSTREAM_KEY not in text
    assert LOCAL_TOKEN not in s.log()


def test_key_swap(sim, shim):
    """The simulator accepts only the upstream key; the harness holds only the local token."""
    url = sim()
    good = shim(url)
    r = httpx.post(f"{good.base}/v1/messages", headers={"x-api-key": LOCAL_TOKEN},
                   json={"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    # a shim holding a wrong upstream key: the provider's 401 comes back, not retried, marked terminal
    bad = shim(url, key="sk-wrong")
    r = httpx.post(f"{bad.base}/v1/chat/completions", headers={"authorization": f"Bearer {LOCAL_TOKEN}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.headers["x-should-retry"] == "false"
    row = bad.rows()[-1]
    assert row["outcome"] == "error" and row["retries"] == 0 and row["http_status"] == 401
    assert "sk-wrong" not in bad.log()


def test_wrong_local_token_and_bad_requests(sim, shim):
    url = sim()
    s = shim(url)
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{s.base}/v1/messages", headers={"x-api-key": "nope"}, json=body)
    assert r.status_code == 401 and r.headers["x-should-retry"] == "false"
    r = httpx.post(f"{s.base}/v1/messages", json=body)  # no credential at all
    assert r.status_code == 401
    r = httpx.post(f"{s.base}/v1/chat/completions", headers={"authorization": f"Bearer {UPSTREAM_KEY}"}, json=body)
    assert r.status_code == 401  # the upstream key is not a local credential
    auth = {"x-api-key": LOCAL_TOKEN}
    r = httpx.post(f"{s.base}/v1/messages", headers=auth, content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{s.base}/v1/messages", headers=auth, json={"max_tokens": 5, "messages": []})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    r = httpx.post(f"{s.base}/v1/embeddings", headers=auth, json=body)
    assert r.status_code == 404 and "unknown route" in r.json()["error"]["message"]
    r = httpx.post(f"{s.base}/v1/messages", headers=auth, json={"model": "m", "messages": "x"})
    assert r.status_code == 400  # the provider's own 400 passes through
    assert r.headers["x-should-retry"] == "false"

    rows = s.rows()
    assert [r["seq"] for r in rows] == list(range(1, 8))
    assert [r["outcome"] for r in rows] == ["unauthorized"] * 3 + ["bad_request"] * 3 + ["error"]
    assert [r["http_status"] for r in rows] == [401, 401, 401, 400, 400, 404, 400]
    assert all(r["cost_usd"] == 0 for r in rows)
    assert sim_stats(url, "claude-sonnet-4-5").get("requests", 0) == 0
    assert s.status()["calls"] == 7


def test_health_and_status(sim, shim):
    s = shim(sim())
    assert httpx.get(f"{s.base}/_shim/health").status_code == 200
    st = s.status()
    assert set(st) >= {"calls", "ledger_rows", "ledger_sent", "stopped", "totals"}
    assert st["totals"] == Totals().model_dump()
    assert math.isclose(st["totals"]["cost_usd"], 0.0)

