"""ProviderKeys: a provider's admin API for a key per run with a spend limit (the run's hard cap, enforced by the
provider), its usage (the third meter) and its revocation. By name in PROVIDER_KEYS; `gateway.provider_keys` in the
spec names one, or a dotted path "package.module:Class" to one kept elsewhere."""

from __future__ import annotations

from dispatcher.provider_keys.base import MintedKey, ProviderKeys
from plumbing.registry import Registry

PROVIDER_KEYS: Registry[type[ProviderKeys]] = Registry("provider keys", base=ProviderKeys)
PROVIDER_KEYS.register("simulator", "dispatcher.provider_keys.simulator:SimulatorKeys")
PROVIDER_KEYS.register("openrouter", "dispatcher.provider_keys.openrouter:OpenRouterKeys")

__all__ = ["PROVIDER_KEYS", "MintedKey", "ProviderKeys"]
