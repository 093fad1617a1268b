"""OpenRouter's management API (docs: "Management API Keys"): a management key, which cannot make completions,
creates keys with a USD `limit` under `/api/v1/keys`, reads a key's `usage` (USD only: OpenRouter reports no calls
or tokens per key) and deletes it. The spec's model.base_url is the account's API base (`.../api/v1`) and
model.api_key_env names the management key; the gateway then calls only with the run's minted key."""

from __future__ import annotations

from urllib.parse import urlsplit

from contract.models import Totals
from dispatcher.provider_keys.base import MintedKey, ProviderKeys


class OpenRouterKeys(ProviderKeys):
    counts_calls = False

    def _call(self, method: str, path: str, **kw) -> dict:
        u = urlsplit(self.base_url)
        return self._request(method, f"{u.scheme}://{u.netloc}/api/v1/keys{path}", **kw)

    def mint(self, name: str, limit_usd: float | None) -> MintedKey:
        k = self._call("POST", "", json={"name": name, "limit": limit_usd})
        return MintedKey(id=k["data"]["hash"], key=k["key"])

    def usage(self, key_id: str) -> Totals:
        return Totals(cost_usd=float(self._call("GET", f"/{key_id}")["data"]["usage"]))

    def revoke(self, key_id: str) -> None:
        self._call("DELETE", f"/{key_id}")
