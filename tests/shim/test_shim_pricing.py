"""contract/pricing.py against LiteLLM's bundled table: 1-hour cache writes at their own rate, above-N-token
tiers, and the shim's usage normalisation feeding them."""

from __future__ import annotations

import pytest

from contract import pricing
from contract.models import Usage as ContractUsage
from shim.wire import CHAT, MESSAGES, Usage, normalise

TIERED = "anthropic.claude-sonnet-4-5-20250929-v1:0"  # bedrock's entry: 1-hour writes and 200k tiers


def _entry(model: str) -> dict:
    return pricing._table(str(pricing.price_file()))[model]


def test_one_hour_cache_writes_have_their_own_rate():
    e = _entry("claude-sonnet-4-5")
    p = pricing.price("claude-sonnet-4-5")
    assert p.cache_write_1h == e["cache_creation_input_token_cost_above_1hr"] != e["cache_creation_input_token_cost"]
    u = Usage(input_tokens=100, cached_tokens=1000, cache_write_tokens=3000, output_tokens=50,
              cache_write_1h_tokens=1000)
    want = (100 * e["input_cost_per_token"] + 1000 * e["cache_read_input_token_cost"]
            + 2000 * e["cache_creation_input_token_cost"] + 1000 * e["cache_creation_input_token_cost_above_1hr"]
            + 50 * e["output_cost_per_token"])
    assert p.cost(u) == pytest.approx(want, rel=1e-12)
    # contract.models.Usage has no 1-hour field: all writes at the 5-minute rate, unless told
    cu = ContractUsage(input_tokens=100, cached_tokens=1000, cache_write_tokens=3000, output_tokens=50)
    assert p.cost(cu) == pytest.approx(want - 1000 * (e["cache_creation_input_token_cost_above_1hr"]
                                                      - e["cache_creation_input_token_cost"]), rel=1e-12)
    assert p.cost(cu, cache_write_1h_tokens=1000) == pytest.approx(want, rel=1e-12)


def test_tiers_above_n_tokens_apply_to_the_whole_call():
    e = _entry(TIERED)
    p = pricing.price(TIERED)
    small = Usage(input_tokens=150_000, cached_tokens=40_000, cache_write_tokens=10_000, output_tokens=1000,
                  cache_write_1h_tokens=4000)  # exactly 200k prompt tokens: not above
    big = Usage(input_tokens=150_001, cached_tokens=40_000, cache_write_tokens=10_000, output_tokens=1000,
                cache_write_1h_tokens=4000)

    def cost(u: Usage, sfx: str) -> float:
        return (u.input_tokens * e["input_cost_per_token" + sfx]
                + u.cached_tokens * e["cache_read_input_token_cost" + sfx]
                + (u.cache_write_tokens - u.cache_write_1h_tokens) * e["cache_creation_input_token_cost" + sfx]
                + u.cache_write_1h_tokens * e["cache_creation_input_token_cost_above_1hr" + sfx]
                + u.output_tokens * e["output_cost_per_token" + sfx])

    assert p.cost(small) == pytest.approx(cost(small, ""), rel=1e-12)
    assert p.cost(big) == pytest.approx(cost(big, "_above_200k_tokens"), rel=1e-12)
    assert p.cost(big) > 1.9 * p.cost(small)
    assert p.rates(200_001).input == e["input_cost_per_token_above_200k_tokens"]


def test_tier_rules_for_partial_entries():
    p = pricing.from_entry({
        "input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6,
        "input_cost_per_token_above_128k_tokens": 2e-6, "output_cost_per_token_above_128k_tokens": 4e-6,
        "input_cost_per_token_above_256k_tokens": 3e-6,
        "input_cost_per_token_above_128k_tokens_priority": 9e-6,  # a service tier: not standard pricing
    })
    r = p.rates(100)
    assert (r.input, r.output, r.cache_read, r.cache_write, r.cache_write_1h) == (1e-6, 2e-6, 1e-6, 1e-6, 1e-6)
    r = p.rates(130_000)  # cache rates the table lacks follow the tier's input rate
    assert (r.input, r.output, r.cache_read, r.cache_write, r.cache_write_1h) == (2e-6, 4e-6, 2e-6, 2e-6, 2e-6)
    r = p.rates(300_000)  # a higher tier keeps the rates it does not list from the one below
    assert (r.input, r.output) == (3e-6, 4e-6)
    flat = pricing.from_entry({"input_cost_per_token": 1e-6, "cache_creation_input_token_cost": 1.25e-6})
    assert flat.cache_write_1h == 1.25e-6 and flat.tiers == ()


def test_usage_normalisation_keeps_the_one_hour_share():
    u = normalise(MESSAGES, {"input_tokens": 5, "cache_creation_input_tokens": 300, "cache_read_input_tokens": 7,
                             "output_tokens": 9,
                             "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200}})
    assert u.model_dump() == {"input_tokens": 5, "cached_tokens": 7, "cache_write_tokens": 300, "output_tokens": 9}
    assert u.cache_write_1h_tokens == 200
    u = normalise(CHAT, {"prompt_tokens": 1000, "completion_tokens": 3,
                         "prompt_tokens_details": {"cached_tokens": 100, "cache_creation_tokens": 50,
                                                   "cache_creation_token_details": {"ephemeral_1h_input_tokens": 50}}})
    assert (u.input_tokens, u.cached_tokens, u.cache_write_tokens, u.cache_write_1h_tokens) == (850, 100, 50, 50)
    assert (u + u).cache_write_1h_tokens == 100
    assert normalise(MESSAGES, {"cache_creation_input_tokens": 10,
                                "cache_creation": {"ephemeral_1h_input_tokens": 99}}).cache_write_1h_tokens == 10


@pytest.mark.parametrize("model,provider", [("claude-sonnet-4-5", "anthropic"), ("gpt-4o-mini", "openai"),
                                            (TIERED, None), ("anthropic/claude-sonnet-4-5", None),
                                            ("gemini-2.5-pro", None)])
def test_price_one_matches_the_table(model, provider):
    assert pricing.price_one(model, provider) == pricing.price(model, provider)


def test_price_one_unknown_model_raises():
    with pytest.raises(pricing.UnknownModel):
        pricing.price_one("no-such-model-anywhere", "anthropic")
