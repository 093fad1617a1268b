"""LiteLLM's `custom_auth` hook (general_settings.custom_auth = gateway.auth.user_api_key_auth): a run's key is
accepted while it is live (minted, not revoked, not expired) and its owner's metered spend is under its budget."""

from __future__ import annotations

from fastapi import Request
from litellm.proxy._types import ProxyException, UserAPIKeyAuth

from gateway.meter import meter


def refusal(message: str, kind: str, status: int) -> ProxyException:
    return ProxyException(message=message, type=kind, param=None, code=status)


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    rt = meter.runtime
    rec = await rt.key(api_key) if api_key else None
    if rec is None:
        raise refusal("gateway: unknown, revoked or expired key", "authentication_error", 401)
    if rec.budget_usd is not None and await rt.spent_usd(rec.owner) >= rec.budget_usd:
        raise refusal(f"gateway: {rec.owner} has spent its budget of ${rec.budget_usd:g}", "budget_exceeded", 403)
    # user_id carries the owner into LiteLLM's logging payload, where the meter reads it back
    return UserAPIKeyAuth(api_key=api_key, user_id=rec.owner, models=rec.aliases,
                          metadata={"owner": rec.owner, "aliases": rec.aliases})
