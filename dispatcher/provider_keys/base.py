"""The ProviderKeys seam: what the dispatcher asks of a provider's admin API."""

from __future__ import annotations

import httpx
from pydantic import BaseModel

from contract.models import Totals


class MintedKey(BaseModel):
    id: str  # the provider's id for the key (usage and revocation name it)
    key: str  # the secret: it goes to the gateway's key file and nowhere else


class ProviderKeys:
    """One provider account, reached with its admin (management) key at base_url."""

    counts_calls = True  # usage() gives calls and tokens by kind; False: its cost only (the reconciliation compares that)

    def __init__(self, base_url: str, admin_key: str):
        self.base_url, self.admin_key = base_url.rstrip("/"), admin_key

    def _request(self, method: str, url: str, **kw) -> dict:
        """One call of the admin API with the account's key as the bearer token, its JSON answer (an error status
        raises httpx.HTTPStatusError)."""
        r = httpx.request(method, url, timeout=30, headers={"Authorization": f"Bearer {self.admin_key}"}, **kw)
        r.raise_for_status()
        return r.json()

    def mint(self, name: str, limit_usd: float | None) -> MintedKey:
        """A new key that the provider refuses once its spend reaches limit_usd."""
        raise NotImplementedError

    def usage(self, key_id: str) -> Totals:
        """The key's answered calls, tokens by kind and cost, as the provider counts them."""
        raise NotImplementedError

    def revoke(self, key_id: str) -> None:
        raise NotImplementedError
