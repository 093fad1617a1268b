"""The simulator's admin API through the ProviderKeys seam: a key minted with a spend limit is refused past it the
way a provider refuses (429, enforced_spend_limit_reached: the shim does not retry it), refused once revoked, and
its usage is what the simulator billed it."""

from __future__ import annotations

import httpx
import pytest

from contract.models import Usage
from contract.pricing import price
from dispatcher.provider_keys import PROVIDER_KEYS
from simulator import SimulatorConfig
from simulator.testing import running_simulator

ORG_KEY = "sk-sim-org-key"
MODEL = "gpt-4o-mini"


def chat(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Fix it." * 50}]})


def test_a_minted_key_is_refused_past_its_limit_and_once_revoked():
    with running_simulator(SimulatorConfig(api_key=ORG_KEY)) as url:
        keys = PROVIDER_KEYS.get("simulator")(url, ORG_KEY)
        minted = keys.mint("run:t", limit_usd=0.00004)
        statuses = [chat(url, minted.key) for _ in range(12)]
        codes = [r.status_code for r in statuses]
        assert codes[0] == 200 and codes[-1] == 429, codes
        assert b"enforced_spend_limit_reached" in statuses[-1].content
        usage = keys.usage(minted.id)
        assert usage.calls == codes.count(200)
        assert usage.cost_usd == pytest.approx(price(MODEL).cost(Usage(**usage.model_dump(
            include={"input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens"}))))
        assert usage.cost_usd >= 0.00004 and usage.cost_usd - usage.cost_usd / usage.calls < 0.00004

        other = keys.mint("run:u", limit_usd=None)
        assert chat(url, other.key).status_code == 200
        keys.revoke(other.id)
        assert chat(url, other.key).status_code == 401
        assert chat(url, ORG_KEY).status_code == 200  # the organisation's own key is untouched
        with pytest.raises(httpx.HTTPStatusError):  # the admin API takes only the organisation's key
            PROVIDER_KEYS.get("simulator")(url, minted.key).usage(minted.id)


def test_openrouter_keys_through_its_management_api_shape():
    """OpenRouterKeys against the simulator's stand-in for OpenRouter's management API (/api/v1/keys): the key's
    limit in USD holds, its usage is its cost only (OpenRouter counts no calls or tokens per key), deleting it ends
    it; the account's base is the API base the spec names (.../api/v1)."""
    with running_simulator(SimulatorConfig(api_key=ORG_KEY)) as url:
        keys = PROVIDER_KEYS.get("openrouter")(url + "/api/v1", ORG_KEY)
        assert keys.counts_calls is False
        minted = keys.mint("run:t", limit_usd=0.00004)
        codes = [chat(url, minted.key).status_code for _ in range(12)]
        assert codes[0] == 200 and codes[-1] == 429, codes
        usage = keys.usage(minted.id)
        billed = PROVIDER_KEYS.get("simulator")(url, ORG_KEY).usage(minted.id)  # what the simulator charged it
        assert (usage.calls, usage.output_tokens) == (0, 0) and usage.cost_usd == pytest.approx(billed.cost_usd)
        assert billed.calls == codes.count(200) and usage.cost_usd >= 0.00004
        keys.revoke(minted.id)
        assert chat(url, minted.key).status_code == 401
        with pytest.raises(httpx.HTTPStatusError) as gone:  # deleted: no longer in the API
            keys.usage(minted.id)
        assert gone.value.response.status_code == 404


def test_the_provider_is_compared_in_what_it_counts():
    from contract.models import Totals
    from dispatcher.report.reconcile import provider_differences

    gateway = Totals(calls=3, input_tokens=30, output_tokens=9, cost_usd=0.003)
    assert provider_differences(gateway.model_copy(), gateway, counts_calls=True) == []
    cost_only = Totals(cost_usd=0.003)
    assert provider_differences(cost_only, gateway, counts_calls=False) == []
    assert provider_differences(cost_only, gateway, counts_calls=True)[0] == "calls 0 vs 3"
    assert provider_differences(Totals(cost_usd=0.004), gateway, counts_calls=False) == [
        "cost $0.004000000 vs $0.003000000"]
