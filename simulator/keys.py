"""Provider keys with spend limits, as a provider's admin API offers them (OpenRouter's key provisioning is the
model): the organisation's key (config.api_key) mints keys, each with an optional limit in USD, reads a key's usage,
revokes it. A minted key is refused once revoked (401) and once its spend reached its limit (429 with
`enforced_spend_limit_reached`, as Anthropic refuses past a spend limit: not to be retried). Spend is priced from
contract.pricing, the table the shim and LiteLLM use, so the three meters are comparable."""

from __future__ import annotations

import secrets

from pydantic import BaseModel, Field

from contract.models import Totals, Usage
from simulator.tokens import Billing

SPEND_LIMIT_CODE = "enforced_spend_limit_reached"


class ProviderKey(BaseModel):
    id: str
    name: str
    key: str
    limit_usd: float | None = None
    revoked: bool = False
    usage: Totals = Field(default_factory=Totals)  # the answered (billed) calls

    def public(self) -> dict:
        """What the admin API shows of a key (never the key itself after minting)."""
        return self.model_dump(exclude={"key"})


class KeyStore:
    def __init__(self) -> None:
        self._by_key: dict[str, ProviderKey] = {}
        self._by_id: dict[str, ProviderKey] = {}

    def mint(self, name: str, limit_usd: float | None) -> ProviderKey:
        k = ProviderKey(id="pk-" + secrets.token_hex(8), name=name, key="sk-sim-pk-" + secrets.token_hex(20),
                        limit_usd=limit_usd)
        self._by_key[k.key], self._by_id[k.id] = k, k
        return k

    def get(self, key_id: str) -> ProviderKey | None:
        return self._by_id.get(key_id)

    def by_key(self, key: str) -> ProviderKey | None:
        return self._by_key.get(key)

    def revoke(self, key_id: str) -> ProviderKey | None:
        k = self._by_id.get(key_id)
        if k is not None:
            k.revoked = True
        return k

    @staticmethod
    def refusal(k: ProviderKey) -> tuple[int, str] | None:
        """(status, message) if the key may not call now."""
        if k.revoked:
            return 401, "this API key has been revoked"
        if k.limit_usd is not None and k.usage.cost_usd >= k.limit_usd:
            return 429, f"this API key has reached its spend limit of ${k.limit_usd:g}"
        return None

    @staticmethod
    def charge(k: ProviderKey, model: str, billing: Billing) -> None:
        from contract.pricing import UnknownModel, price

        usage = Usage(input_tokens=billing.input_tokens, cached_tokens=billing.cached_tokens,
                      cache_write_tokens=billing.cache_write_tokens, output_tokens=billing.output_tokens)
        try:
            cost = price(model).cost(usage)
        except UnknownModel:
            cost = 0.0  # an unpriced model costs nothing here (as in the shim's ledger)
        k.usage.add(usage, cost)

    def clear(self) -> None:
        self._by_key.clear()
        self._by_id.clear()
