"""The gateway tier for real: two LiteLLM replicas behind haproxy, the simulator as the provider, PostgreSQL and
Valkey. A run's key serves its aliases only, while it is live and under its budget; every call served lands one
gateway row whose call id is the one the answer carried; losing a replica loses no call."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from contract.models import Usage
from contract.pricing import price
from gateway import aliases, keyfile, keys, tier
from gateway.tier import provider_keys_file
from plumbing.services import recorded_pid
from simulator import SimulatorConfig
from simulator.testing import running_simulator

MODEL = "claude-sonnet-4-5"


@pytest.fixture(scope="module")
def provider():
    with running_simulator(SimulatorConfig(api_key="sk-sim-gw-test")) as url:
        yield url


@pytest.fixture
def run_key(gateway_tier, provider, pg, valkey, unique):
    """(key, alias, owner): a key minted for a run of its own, on an alias of its own routed to the simulator."""
    state, _ = gateway_tier
    keyfile.put(provider_keys_file(state), f"sim-{unique}", "sk-sim-gw-test")
    alias = f"{MODEL}@{unique}"
    aliases.register(pg, alias, [aliases.Deployment(model=f"anthropic/{MODEL}", api_base=provider,
                                                    key_name=f"sim-{unique}")])
    key = "sk-run-" + unique
    keys.mint(pg, valkey, key, keys.KeyRecord(owner=unique, aliases=[alias], budget_usd=None,
                                              expires_at=keys.expiry(600)))
    return key, alias, unique


def chat(url: str, key: str, model: str, text: str = "Fix the bug.") -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": text}]})


def messages(url: str, key: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages", headers={"x-api-key": key}, timeout=60, json={
        "model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "Fix the bug."}]})


def gateway_rows(pg, owner: str, n: int, timeout_s: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        cur = pg.execute("SELECT * FROM gateway_calls WHERE owner = %s AND status = 'ok'", (owner,))
        rows = [dict(zip([c.name for c in cur.description], r)) for r in cur.fetchall()]
        pg.commit()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_calls_on_both_routes_land_one_row_each_with_the_answers_call_id(gateway_tier, run_key, pg):
    _, info = gateway_tier
    key, alias, owner = run_key
    answers = [chat(info.url, key, alias), messages(info.url, key, alias), chat(info.url, key, alias, "Again.")]
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    rows = {r["gateway_call_id"]: r for r in gateway_rows(pg, owner, 3)}
    assert set(rows) == {r.headers["x-litellm-call-id"] for r in answers}
    for r in answers:
        row = rows[r.headers["x-litellm-call-id"]]
        usage = r.json()["usage"]
        out = usage.get("completion_tokens", usage.get("output_tokens"))
        assert (row["alias"], row["output_tokens"]) == (alias, out)
        assert row["deployment"].startswith(f"anthropic/{MODEL}@")
        tokens = Usage(**{f: row[f] for f in ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")})
        assert float(row["cost_usd"]) == pytest.approx(price(MODEL).cost(tokens), rel=1e-6)
    assert len({r["replica"] for r in rows.values()}) >= 1


def test_a_retry_of_an_answered_attempt_gets_its_answer_again_and_is_not_billed_twice(gateway_tier, run_key, pg,
                                                                                       valkey):
    """The shim names its attempts (x-litellm-call-id) and a retry the attempts before it: an answer lost on its
    way back (a replica killed after answering) is replayed, not asked of the provider again."""
    _, info = gateway_tier
    key, alias, owner = run_key
    body = {"model": alias, "max_tokens": 64, "messages": [{"role": "user", "content": "Fix the bug."}]}
    calls = {f"{owner}-chat": ("/v1/chat/completions", {"Authorization": f"Bearer {key}"}),
             f"{owner}-messages": ("/v1/messages", {"x-api-key": key})}
    for call, (route, auth) in calls.items():
        first = httpx.post(info.url + route, json=body, timeout=60, headers={**auth, "x-litellm-call-id": f"{call}:1"})
        retry = httpx.post(info.url + route, json=body, timeout=60, headers={
            **auth, "x-litellm-call-id": f"{call}:2", "x-evalplane-replay-of": f"{call}:0,{call}:1"})
        assert (first.status_code, retry.status_code) == (200, 200), (first.text, retry.text)
        assert first.headers["x-litellm-call-id"] == retry.headers["x-litellm-call-id"] == f"{call}:1"
        assert retry.content == first.content and retry.headers.get("x-evalplane-replayed") == "true"
        assert "x-evalplane-replayed" not in first.headers
    # another key (another run) finds nothing to replay under the same names: its retry is a call of its own
    other = "sk-run-other-" + owner
    keys.mint(pg, valkey, other, keys.KeyRecord(owner=owner + "-other", aliases=[alias], expires_at=keys.expiry(600)))
    stranger = httpx.post(info.url + "/v1/chat/completions", json=body, timeout=60, headers={
        "Authorization": f"Bearer {other}", "x-litellm-call-id": f"{owner}-stranger:2",
        "x-evalplane-replay-of": f"{owner}-chat:1"})
    assert stranger.status_code == 200 and stranger.headers["x-litellm-call-id"] == f"{owner}-stranger:2"
    assert "x-evalplane-replayed" not in stranger.headers
    gateway_rows(pg, owner, 2)
    time.sleep(1.0)  # a row for a replayed call would have landed by now
    rows = gateway_rows(pg, owner, 3, timeout_s=0)
    assert sorted(r["gateway_call_id"] for r in rows) == sorted(f"{call}:1" for call in calls)


def test_a_key_is_refused_outside_its_scope_after_revocation_and_past_expiry(gateway_tier, run_key, pg, valkey):
    _, info = gateway_tier
    key, alias, owner = run_key
    assert chat(info.url, "sk-run-unknown", alias).status_code == 401
    assert chat(info.url, key, "gpt-5").status_code == 403  # an alias the key was not minted for
    assert chat(info.url, key, alias).status_code == 200
    keys.revoke(pg, valkey, owner)
    assert chat(info.url, key, alias).status_code == 401
    keys.mint(pg, valkey, key, keys.KeyRecord(owner=owner, aliases=[alias], expires_at=keys.expiry(1)))
    time.sleep(1.5)
    assert chat(info.url, key, alias).status_code == 401


def test_a_key_past_its_budget_is_refused(gateway_tier, run_key, pg, valkey):
    _, info = gateway_tier
    key, alias, owner = run_key
    keys.mint(pg, valkey, key, keys.KeyRecord(owner=owner, aliases=[alias], budget_usd=0.0005,
                                              expires_at=keys.expiry(600)))
    statuses = [chat(info.url, key, alias).status_code for _ in range(8)]
    assert statuses[0] == 200 and statuses[-1] == 403, statuses
    spent = sum(float(r["cost_usd"]) for r in gateway_rows(pg, owner, statuses.count(200)))
    # refused from the first call after the meter reached the budget: over it by at most the last call
    assert spent >= 0.0005 and statuses.count(200) == statuses.index(403)
    assert spent - max(float(r["cost_usd"]) for r in gateway_rows(pg, owner, 1)) < 0.0005


def test_a_replica_killed_mid_run_loses_no_call(gateway_tier, run_key, pg):
    """SIGKILL one replica while calls go: haproxy sends the rest to the other, and every call answered has its
    row (the killed replica's unwritten rows wait in Valkey for the survivor's drain)."""
    state, info = gateway_tier
    key, alias, owner = run_key
    victim = next(iter(info.replicas))
    answered, failed = [], 0
    for i in range(30):
        if i == 10:
            os.kill(recorded_pid(state / "gateway" / f"{victim}.pid"), signal.SIGKILL)
        r = chat(info.url, key, alias, f"call {i}")
        if r.status_code == 200:
            answered.append(r.headers["x-litellm-call-id"])
        else:
            failed += 1  # cut mid-way: the shim retries these (502); here the client just counts them
    assert failed <= 2 and len(answered) >= 28
    rows = gateway_rows(pg, owner, len(answered))
    assert {r["gateway_call_id"] for r in rows} >= set(answered)
    assert tier.ensure(state, info.database_url, info.valkey_url) == info  # the tier starts the lost replica again
    assert recorded_pid(state / "gateway" / f"{victim}.pid") is not None


def test_the_cap_on_the_provider_key_holds_without_the_shim(gateway_tier, provider, pg, valkey, unique):
    """A client calling the gateway directly with a run's key (no budget of its own) whose deployment uses a
    provider key minted with a spend limit: the provider refuses past the limit, and the gateway passes the refusal
    on in a form the shim does not retry."""
    from dispatcher.provider_keys import PROVIDER_KEYS
    from gateway import runs

    state, info = gateway_tier
    admin = PROVIDER_KEYS.get("simulator")(provider, "sk-sim-gw-test")
    minted = admin.mint(f"run:{unique}", limit_usd=0.0005)
    keyfile.put(provider_keys_file(state), runs.key_name(minted.key), minted.key)
    alias = f"{MODEL}@{unique}"
    aliases.register(pg, alias, [runs.deployment("anthropic", MODEL, provider, runs.key_name(minted.key))])
    keys.mint(pg, valkey, "sk-run-" + unique, keys.KeyRecord(owner=unique, aliases=[alias], expires_at=keys.expiry(600)))
    answers = [chat(info.url, "sk-run-" + unique, alias) for _ in range(10)]
    codes = [r.status_code for r in answers]
    assert codes[0] == 200 and codes[-1] == 429, codes
    assert b"enforced_spend_limit_reached" in answers[-1].content
    usage = admin.usage(minted.id)
    assert usage.calls == codes.count(200) and usage.cost_usd - usage.cost_usd / usage.calls < 0.0005


def test_an_alias_registered_again_routes_only_to_its_new_deployments(gateway_tier, provider, pg, valkey, unique):
    state, info = gateway_tier
    key, alias = "sk-run-" + unique, f"{MODEL}@{unique}"
    keyfile.put(provider_keys_file(state), f"sim-{unique}", "sk-sim-gw-test")
    keys.mint(pg, valkey, key, keys.KeyRecord(owner=unique, aliases=[alias], expires_at=keys.expiry(600)))

    def served(url: str) -> int:
        return httpx.get(f"{url}/_sim/stats").json()["models"].get(MODEL, {}).get("requests", 0)

    def route_to(url: str) -> None:
        aliases.register(pg, alias, [aliases.Deployment(model=f"anthropic/{MODEL}", api_base=url,
                                                        key_name=f"sim-{unique}")])
        time.sleep(6)  # past the replicas' alias refresh

    with running_simulator(SimulatorConfig(api_key="sk-sim-gw-test")) as second:
        route_to(provider)
        assert all(chat(info.url, key, alias).status_code == 200 for _ in range(4))
        route_to(second)
        before = served(provider)
        assert all(chat(info.url, key, alias).status_code == 200 for _ in range(6))
        assert (served(provider) - before, served(second)) == (0, 6)
