"""The pool-limit controller: discovery from real header names, decrease on 429s, recovery when quiet."""

from dispatcher.driver.pacing import PacerPolicy


def test_discovered_limits_from_anthropic_and_litellm_prefixed_headers():
    p = PacerPolicy(safety=0.8)
    headers = {"anthropic-ratelimit-requests-limit": "1000", "llm_provider-anthropic-ratelimit-input-tokens-limit":
               "400000", "anthropic-ratelimit-output-tokens-limit": "80000", "anthropic-ratelimit-tokens-reset": "x"}
    assert p.discovered(headers) == {"rpm": 800, "itpm": 320000, "otpm": 64000}
    assert p.discovered({"x-ratelimit-limit-requests": "60", "x-ratelimit-limit-tokens": "150000"}) == {
        "rpm": 48, "itpm": 120000}


def test_decrease_on_429s_is_debounced_then_recovers_after_quiet():
    p = PacerPolicy(safety=1.0, decrease=0.5, increase_frac=0.1, quiet_s=60, debounce_s=15)
    s = p.initial({"rpm": 100, "itpm": None, "otpm": None})
    assert s.limits == {"rpm": 100} and s.source == "spec"
    s = p.tick(s, {}, throttled_total=3, now=1000)
    assert s.limits["rpm"] == 50 and s.source == "adapted" and s.decreases == 1
    s = p.tick(s, {}, throttled_total=5, now=1005)  # within the debounce window: no second cut
    assert s.limits["rpm"] == 50 and s.decreases == 1
    s = p.tick(s, {}, throttled_total=5, now=1030)  # quiet, but not for long enough
    assert s.limits["rpm"] == 50
    s = p.tick(s, {}, throttled_total=5, now=1066)
    assert s.limits["rpm"] == 60 and s.increases == 1
    s = p.tick(s, {}, throttled_total=5, now=1070)  # one step per quiet period
    assert s.limits["rpm"] == 60
    for t in range(1130, 1130 + 60 * 10, 61):
        s = p.tick(s, {}, throttled_total=5, now=t)
    assert s.limits["rpm"] == 100  # back to the ceiling, never above


def test_discovered_ceiling_caps_spec_limits():
    p = PacerPolicy(safety=0.9)
    s = p.initial({"rpm": 5000})
    s = p.tick(s, {"x-ratelimit-limit-requests": "1000"}, throttled_total=0, now=0)
    assert s.limits["rpm"] == 900 and s.ceiling["rpm"] == 900 and s.source == "discovered"


def test_spec_limits_the_provider_allows_are_paced_exactly_and_headers_are_followed_both_ways():
    p = PacerPolicy(safety=0.9)
    s = p.initial({"rpm": 1000, "itpm": 400_000})
    agree = {"anthropic-ratelimit-requests-limit": "1000", "anthropic-ratelimit-input-tokens-limit": "400000"}
    s = p.tick(s, agree, throttled_total=0, now=0)
    assert s.limits == {"rpm": 1000, "itpm": 400_000}  # the spec's share, not cut by the safety factor
    s = p.tick(s, agree, throttled_total=40, now=10)  # 429s with headers: no cut, the shims hold back
    assert s.limits == {"rpm": 1000, "itpm": 400_000} and s.decreases == 0
    halved = {"anthropic-ratelimit-requests-limit": "500", "anthropic-ratelimit-input-tokens-limit": "200000"}
    s = p.tick(s, halved, throttled_total=45, now=20)
    assert s.limits == {"rpm": 450, "itpm": 180_000}  # below the spec: the provider's, with the safety factor
    s = p.tick(s, agree, throttled_total=45, now=30)
    assert s.limits == {"rpm": 1000, "itpm": 400_000}  # raised again: back up at once
    unknown = p.tick(p.initial({}), agree, throttled_total=0, now=0)
    assert unknown.limits == {"rpm": 900, "itpm": 360_000} and unknown.source == "discovered"
