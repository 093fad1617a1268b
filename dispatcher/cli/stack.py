"""The local stack's Valkey, as commands need it (PostgreSQL's side is dispatcher.store.connect): its URL, and a
check that it answers before a command starts anything that needs it."""

from __future__ import annotations

import redis

from contract import valkey_auth
from dispatcher.store import StackDown

PING_TIMEOUT_S = 5


def valkey_url() -> str:
    """VALKEY_URL, else the project's own Valkey's admin URL (scripts/stack.sh up); StackDown when neither is set."""
    try:
        return valkey_auth.default_url()
    except RuntimeError as e:  # default_url's one failure: no URL and no admin file
        raise StackDown("Valkey", "", str(e).split(": run ")[0]) from None


def require_valkey() -> str:
    """valkey_url(), once it answers a PING."""
    url = valkey_url()
    try:
        redis.Redis.from_url(url, socket_connect_timeout=PING_TIMEOUT_S, socket_timeout=PING_TIMEOUT_S).ping()
    except redis.RedisError as e:
        raise StackDown("Valkey", valkey_auth.without_credentials(url), str(e)) from None
    return url
