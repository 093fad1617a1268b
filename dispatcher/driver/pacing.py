"""A pool's limits over time: from the spec, then discovered from provider headers, then adapted.

Plain Python (the PoolPacer actor wraps it): the shims pace every call against the limits this
writes to Valkey (contract.keys.pool_limits); this decides what those limits are.
  - discovered: the provider's own `*-limit` headers the shims recorded, times a safety factor
    (the key is shared with others, and providers' buckets are not exactly ours);
  - adapted: a multiplicative decrease when the shims saw 429s since the last tick (debounced),
    an additive increase back toward the ceiling after a quiet period (Inspect AI's controller shape).
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
    throttled_seen: int = 0  # the shims' 429 counter at the last tick
    last_decrease: float = 0.0
    last_throttle: float = 0.0
    decreases: int = 0
    increases: int = 0


class PacerPolicy:
    def __init__(self, safety: float = 0.85, decrease: float = 0.7, increase_frac: float = 0.05,
                 quiet_s: float = 60.0, debounce_s: float = 15.0, floor_frac: float = 0.05):
        self.safety, self.decrease, self.increase_frac = safety, decrease, increase_frac
        self.quiet_s, self.debounce_s, self.floor_frac = quiet_s, debounce_s, floor_frac

    def initial(self, spec_limits: dict[str, int | None]) -> PacerState:
        limits = {k: int(v) for k, v in spec_limits.items() if v}
        return PacerState(limits=dict(limits), ceiling=dict(limits), source="spec")

    def discovered(self, headers: dict[str, str]) -> dict[str, int]:
        found: dict[str, int] = {}
        for header, value in headers.items():
            dim = HEADER_LIMITS.get(header.lower().removeprefix("llm_provider-"))
            try:
                n = int(float(value))
            except (TypeError, ValueError):
                continue
            if dim and n > 0:
                found[dim] = min(found.get(dim, n), n)
        return {d: max(1, int(n * self.safety)) for d, n in found.items()}

    def tick(self, state: PacerState, headers: dict[str, str], throttled_total: int, now: float) -> PacerState:
        s = state.model_copy(deep=True)
        found = self.discovered(headers)
        if found and found != s.ceiling:
            for d, n in found.items():  # discovered limits are the ceiling; never pace above them
                s.ceiling[d] = n
                s.limits[d] = min(s.limits.get(d, n), n) if s.source == "adapted" else n
            s.source = "discovered" if s.source != "adapted" else s.source
        new_429s = throttled_total - s.throttled_seen
        s.throttled_seen = throttled_total
        if new_429s > 0:
            s.last_throttle = now
            if now - s.last_decrease >= self.debounce_s:
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
                s.source = "discovered" if found or s.ceiling else "spec"
        return s
