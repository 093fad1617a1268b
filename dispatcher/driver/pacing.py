"""A pool's limits over time: from the spec, then discovered from provider headers, then adapted.

Plain Python (the PoolPacer actor wraps it): the shims pace every call against the limits this
writes to Valkey (contract.keys.pool_limits); this decides what those limits are.
  - discovered: the provider's own `*-limit` headers the shims recorded, times a safety factor
    (the key may be shared with others, and providers' buckets are not exactly ours); a spec limit
    no higher than the provider's is the pool's share as its owner stated it, and is paced exactly.
    The headers are followed both ways: a provider that lowers its limits (or raises them again)
    says so in the headers of the next answers, which the shims record at once on a 429;
  - adapted: only where no headers say the limits, a multiplicative decrease when the shims saw 429s
    since the last tick (debounced), an additive increase back toward the ceiling after a quiet
    period (Inspect AI's controller shape). With headers, a 429 only holds the pool back for its
    retry-after (the shims' THROTTLE): cutting the limits for it would leave them idle for minutes.
"""

from __future__ import annotations

from pydantic import BaseModel

DIMENSIONS = ("rpm", "itpm", "otpm")

# Header (as the shim records it, lower-case, llm_provider- prefix stripped) -> dimension.
HEADER_LIMITS = {
    "x-ratelimit-limit-requests": "rpm",
    "x-ratelimit-limit-tokens": "itpm",  # OpenAI's TPM counts input + max_tokens: pace input against it
    "anthropic-ratelimit-requests-limit": "rpm",
    "anthropic-ratelimit-input-tokens-limit": "itpm",
    "anthropic-ratelimit-output-tokens-limit": "otpm",
}


class PacerState(BaseModel):
    """What Valkey keeps for a pool, so a restarted PoolPacer resumes where it was."""

    limits: dict[str, int] = {}  # what the shims pace against now
    ceiling: dict[str, int] = {}  # the most we will go back up to
    source: str = "spec"  # spec | discovered | adapted
    spec: dict[str, int] = {}  # the spec's limits
    provider: dict[str, int] = {}  # the provider's limits, as its headers last said
    throttled_seen: int = 0  # the shims' 429 counter at the last tick
    last_decrease: float = 0.0
    last_throttle: float = 0.0
    decreases: int = 0
    increases: int = 0


class PacerPolicy:
    def __init__(self, safety: float = 0.95, decrease: float = 0.7, increase_frac: float = 0.05,
                 quiet_s: float = 60.0, debounce_s: float = 15.0, floor_frac: float = 0.05):
        self.safety, self.decrease, self.increase_frac = safety, decrease, increase_frac
        self.quiet_s, self.debounce_s, self.floor_frac = quiet_s, debounce_s, floor_frac

    def initial(self, spec_limits: dict[str, int | None]) -> PacerState:
        limits = {k: int(v) for k, v in spec_limits.items() if v}
        return PacerState(limits=dict(limits), ceiling=dict(limits), source="spec", spec=dict(limits))

    def discovered(self, headers: dict[str, str]) -> dict[str, int]:
        """The limits to pace at, from the provider's headers (the safety factor applied)."""
        return {d: max(1, int(n * self.safety)) for d, n in self.provider_limits(headers).items()}

    def provider_limits(self, headers: dict[str, str]) -> dict[str, int]:
        found: dict[str, int] = {}
        for header, value in headers.items():
            dim = HEADER_LIMITS.get(header.lower().removeprefix("llm_provider-"))
            try:
                n = int(float(value))
            except (TypeError, ValueError):
                continue
            if dim and n > 0:
                found[dim] = min(found.get(dim, n), n)
        return found

    def tick(self, state: PacerState, headers: dict[str, str], throttled_total: int, now: float) -> PacerState:
        s = state.model_copy(deep=True)
        provider = self.provider_limits(headers)
        if provider and provider != s.provider:
            s.provider = provider
            for d, n in provider.items():  # the ceiling, followed down and back up
                spec = s.spec.get(d)
                s.ceiling[d] = s.limits[d] = spec if spec and spec <= n else max(1, int(n * self.safety))
            s.source = "discovered"
        new_429s = throttled_total - s.throttled_seen
        s.throttled_seen = throttled_total
        if new_429s > 0:
            s.last_throttle = now
            if not s.provider and now - s.last_decrease >= self.debounce_s:
                for d, n in s.limits.items():
                    floor = max(1, int(s.ceiling.get(d, n) * self.floor_frac))
                    s.limits[d] = max(floor, int(n * self.decrease))
                s.last_decrease, s.decreases, s.source = now, s.decreases + 1, "adapted"
        elif s.source == "adapted" and now - max(s.last_throttle, s.last_decrease) >= self.quiet_s:
            grew = False
            for d, n in s.limits.items():
                top = s.ceiling.get(d, n)
                if n < top:
                    s.limits[d] = min(top, n + max(1, int(top * self.increase_frac)))
                    grew = True
            if grew:
                s.increases += 1
                s.last_decrease = now  # one step per quiet period
            else:
                s.source = "spec"
        return s
