"""The provider simulator's admin API (simulator/keys.py), shaped like OpenRouter's key provisioning."""

from __future__ import annotations

from contract.models import Totals
from dispatcher.provider_keys.base import MintedKey, ProviderKeys


class SimulatorKeys(ProviderKeys):
    def _call(self, method: str, path: str, **kw) -> dict:
        return self._request(method, f"{self.base_url}/_sim/admin/keys{path}", **kw)

    def mint(self, name: str, limit_usd: float | None) -> MintedKey:
        k = self._call("POST", "", json={"name": name, "limit_usd": limit_usd})
        return MintedKey(id=k["id"], key=k["key"])

    def usage(self, key_id: str) -> Totals:
        return Totals.model_validate(self._call("GET", f"/{key_id}")["usage"])

    def revoke(self, key_id: str) -> None:
        self._call("DELETE", f"/{key_id}")
