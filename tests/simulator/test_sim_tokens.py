"""Token estimates, conversation caching and the billing split, without a server."""

from __future__ import annotations

from simulator.tokens import Billing, Prompt, PromptCache, estimate

USER = {"role": "user", "content": "Fix the bug in parse()."}
ANSWER = {"role": "assistant", "content": "Looking at it now."}
MARKED = {
    "role": "user",
    "content": [{"type": "text", "text": "ok " * 30, "cache_control": {"type": "ephemeral"}}],
}


def test_estimate_is_chars_over_four_rounded_up():
    assert estimate("") == 0 and estimate(None) == 0
    assert estimate("abcd") == 1 and estimate("abcde") == 2
    assert estimate({"a": 1}) == 2  # canonical JSON '{"a":1}' has 7 characters


def test_only_an_extension_of_a_remembered_prompt_is_cached():
    cache = PromptCache(size=10)
    first = Prompt.of(None, [USER])
    assert cache.cached_tokens("openai", first) == 0
    cache.remember("openai", first)
    longer = Prompt.of(None, [USER, ANSWER, USER])
    assert cache.cached_tokens("openai", longer) == first.total
    assert cache.cached_tokens("anthropic", longer) == 0  # each route has its own cache
    forked = Prompt.of({"tools": ["bash"]}, [USER, ANSWER])  # same messages, different preamble
    assert cache.cached_tokens("openai", forked) == 0


def test_concurrent_attempts_do_not_evict_each_other():
    cache = PromptCache(size=10)
    turn1 = Prompt.of(None, [USER, ANSWER, USER])
    cache.remember("r", Prompt.of(None, [USER]))
    cache.remember("r", turn1)  # attempt 1 moves on
    cache.remember("r", Prompt.of(None, [USER]))  # attempt 2 starts over
    turn2 = Prompt.of(None, [USER, ANSWER, USER, ANSWER, USER])
    assert cache.cached_tokens("r", turn2) == turn1.total  # the longest remembered prefix


def test_cache_forgets_the_least_recently_used_prompt():
    cache = PromptCache(size=2)
    prompts = [Prompt.of(None, [{"role": "user", "content": f"task {i}"}]) for i in range(3)]
    for prompt in prompts:
        cache.remember("r", prompt)
    assert cache.cached_tokens("r", prompts[0]) == 0
    assert cache.cached_tokens("r", prompts[2]) == prompts[2].total


def test_cache_writes_cover_the_new_tokens_up_to_the_last_marker():
    prompt = Prompt.of({"system": "sys"}, [USER, ANSWER, MARKED, {"role": "assistant", "content": "tail"}])
    assert prompt.marker == 3
    cached = estimate({"system": "sys"}) + estimate(USER)
    billing = Billing.of(prompt, cached, 5, writes_cache=True)
    assert billing.cache_write_tokens == estimate(ANSWER) + estimate(MARKED)
    assert billing.input_tokens == estimate({"role": "assistant", "content": "tail"})
    assert billing.prompt_tokens == prompt.total
    no_writes = Billing.of(prompt, cached, 5, writes_cache=False)
    assert (no_writes.cache_write_tokens, no_writes.input_tokens) == (0, prompt.total - cached)
