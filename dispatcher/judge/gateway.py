"""The judge through the gateway tier: its calls go shim → gateway → provider under a gateway key of the judge's own
(owner: the judge's run name, <run>.judge) whose budget is the judge's --budget-usd, scoped to an alias of its own;
the provider key stays with the tier.

Locally (`judge RUN --gateway`) the provider key (the judge's simulator's, or --api-key-env's) goes into the local
tier's key file, and the key is revoked when the pass ends, the pass's meter rows waited for (gateway.runs.close_run).
On AWS the dispatcher mints the key in the estate's database before it starts the judge's task (dispatcher/judge/
ecs.py): the provider key is the gateway's own (named by --api-key-env in its store), and the key lives until the
run's next pass revokes it, it expires, or its budget is spent (the task's Valkey user cannot revoke it)."""

from __future__ import annotations

import secrets

import psycopg
import redis

from gateway.runs import RunGateway

# A pass that outlives this mints a new key on its rerun; a killed pass's key is revoked by the next pass (open_owner)
KEY_TTL_S = 24 * 3600.0


def judge_alias(pool: str, judge_run: str) -> str:
    """The judge's alias: its own, as a run on its own simulator has (the upstream is the judge's alone), and new
    for each pass: a rerun's upstream is another simulator, which a replica would not see under the old alias until
    its next re-read (gateway.config alias_refresh_s)."""
    return f"{pool}/{judge_run}/{secrets.token_hex(4)}"


def mint_judge(database_url: str, valkey_url: str, judge_run: str, gateway_url: str, pool: str, provider: str,
               model: str, upstream: str, key_name: str, budget_usd: float) -> RunGateway:
    """The judge's alias with `model` at `upstream` (under the gateway's provider key `key_name`) as its deployment,
    and the judge's key minted (the run's earlier pass's revoked): what the judge's shims get."""
    from gateway import runs

    with psycopg.connect(database_url) as conn:
        return runs.open_owner(conn, redis.Redis.from_url(valkey_url), judge_run, gateway_url,
                               judge_alias(pool, judge_run), [runs.deployment(provider, model, upstream, key_name)],
                               key="sk-judge-" + secrets.token_hex(24), budget_usd=budget_usd, ttl_s=KEY_TTL_S)


def open_judge(database_url: str, valkey_url: str, judge_run: str, pool: str, provider: str, model: str,
               upstream: str, provider_key: str, budget_usd: float, replicas: int = 2) -> RunGateway:
    """The local tier running (started if it is not), the provider key in its key file, and the judge's alias and
    key (mint_judge): what the judge's shims get instead of `provider_key`."""
    from dispatcher.backends import daemons
    from gateway import runs, tier

    info = daemons.ensure_gateway(valkey_url, replicas)
    name = runs.put_provider_key(tier.provider_keys_file(daemons.state_dir()), provider_key)
    return mint_judge(database_url, valkey_url, judge_run, info.url, pool, provider, model, upstream, name, budget_usd)


def close_judge(database_url: str, valkey_url: str, judge_run: str) -> bool:
    """The judge's key refused from now on; True once its meter rows have landed in gateway_calls."""
    from gateway import runs

    with psycopg.connect(database_url) as conn:
        return runs.close_run(conn, redis.Redis.from_url(valkey_url), judge_run)
