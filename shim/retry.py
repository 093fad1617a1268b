"""Backoff: honour retry-after / retry-after-ms (also LiteLLM's llm_provider- copies), else full jitter."""

from __future__ import annotations

import random
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime


def retry_after_s(headers: Mapping[str, str] | None) -> float | None:
    """Seconds the upstream asked us to wait, if it said."""
    if not headers:
        return None
    for prefix in ("", "llm_provider-"):
        ms = headers.get(prefix + "retry-after-ms")
        if ms:
            try:
                return max(float(ms) / 1000.0, 0.0)
            except ValueError:
                pass
        s = headers.get(prefix + "retry-after")
        if s:
            try:
                return max(float(s), 0.0)
            except ValueError:
                try:
                    when = parsedate_to_datetime(s)
                    return max((when - datetime.now(UTC)).total_seconds(), 0.0)
                except (TypeError, ValueError):
                    pass
    return None


class Backoff:
    def __init__(self, base_s: float, cap_s: float, max_retry_after_s: float, rng: random.Random | None = None):
        self.base_s = base_s
        self.cap_s = cap_s
        self.max_retry_after_s = max_retry_after_s
        self.rng = rng or random.Random()

    def delay(self, retry: int, headers: Mapping[str, str] | None = None) -> float:
        """Delay before retry number `retry` (1-based)."""
        asked = retry_after_s(headers)
        if asked is not None:
            # a little jitter so that many shims told the same moment don't stampede
            return min(asked, self.max_retry_after_s) + self.rng.uniform(0, min(0.25, self.base_s))
        return self.rng.uniform(0, min(self.cap_s, self.base_s * (2 ** (retry - 1))))
