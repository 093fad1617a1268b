"""Valkey with AUTH on the local stack (scripts/stack.sh: the project's own server, no default user) and the per-run
users the dispatcher makes (contract/valkey_auth.py): no connection without a user and its password; a run's user
does everything the shim and the task runner do with its own run's keys (the real admission scripts) and cannot
read or write another run's keys, the PoolPacer's state or the dashboard's, nor run admin commands."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from contract import keys, signing, valkey_auth
from contract.models import AttemptRef
from shim.admission import Gate
from shim.breaker import Breaker
from shim.caps import ValkeyBudget
from shim.hold import RunHold, set_hold
from shim.pacer import PaceRequest, ValkeyPacer
from shim.progress import SessionProgress


@pytest.fixture
def two_runs(valkey_url, valkey, unique):
    """Two runs on one pool, each with its own user, as dispatcher.driver.loop makes them; both removed at the end."""
    pool = f"{unique}-pool"
    runs = {}
    for n in ("a", "b"):
        run = f"{unique}{n}"
        password = signing.valkey_password(f"{unique}-secret-{n}".encode())
        user = valkey_auth.ensure_run_user(valkey, run, pool, password)
        runs[n] = (run, valkey_auth.with_credentials(valkey_auth.without_credentials(valkey_url), user, password))
    yield pool, runs
    for run, _ in runs.values():
        valkey_auth.remove_run_user(valkey, run)
        for k in valkey.scan_iter(match=f"ep:run:{{{run}}}:*"):
            valkey.delete(k)
        set_hold(valkey, run, False)
    for k in (keys.pool_pacer(pool), keys.pool_limits(pool), keys.pool_discovered(pool), keys.pool_state(pool),
              keys.pool_breaker(pool)):
        valkey.delete(k)


def test_the_server_refuses_connections_without_credentials(valkey_url, two_runs):
    assert valkey_auth.has_credentials(valkey_url)  # the stack's admin URL carries its user and password
    bare = valkey_auth.without_credentials(valkey_url)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(bare).ping()
    _, runs = two_runs
    run, url = runs["a"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url.replace(":" + url.split(":")[2].split("@")[0] + "@", ":not-the-password@")).ping()
    with pytest.raises(redis.AuthenticationError):  # another run's user with this run's password
        redis.Redis.from_url(url.replace(valkey_auth.run_user(run), valkey_auth.run_user(runs["b"][0]))).ping()
    assert redis.Redis.from_url(url).ping()


def test_a_runs_user_works_its_own_keys_and_no_one_elses(valkey, two_runs):
    pool, runs = two_runs
    (run_a, url_a), (run_b, url_b) = runs["a"], runs["b"]
    valkey.hset(keys.pool_limits(pool), mapping={"rpm": 600})  # the PoolPacer's (admin's) doing
    valkey.set(keys.pool_state(pool), "{}")
    for run in (run_a, run_b):
        set_hold(valkey, run, True)  # `pause --hold-calls`: the dispatcher's (admin's) doing

    async def as_task(run: str, url: str) -> tuple:
        """What a task's shim does: hold + admit, settle + progress (the real scripts), under the run's user."""
        r = aioredis.Redis.from_url(url)
        ref = AttemptRef(run=run, instance_id="i", attempt=1)
        budget = ValkeyBudget(r, ref, 1.0, 2.0, 60.0)
        gate = Gate(budget, ValkeyPacer(r, pool, burst_s=1.0), SessionProgress(r, ref, pool), r)
        held = await gate.hold("c1", 100, PaceRequest(pool, 10, 10))
        await gate.after([("c1", 40, None, None, None)], {"phase": "harness", "calls": 1})
        breaker = Breaker(r, pool)  # the pool's outage breaker: reported to and read
        await breaker.failed()
        await breaker.open_for_s(fresh=True)
        await breaker.probe()
        await breaker.ok()
        held_for = await RunHold(r, run).open_for_s(fresh=True)  # the run's call hold: read
        await r.aclose()
        return held, held_for is not None

    assert asyncio.run(as_task(run_a, url_a)) == ((0, 0.0), True)
    assert asyncio.run(as_task(run_b, url_b)) == ((0, 0.0), True)
    spent = {run: int(valkey.hget(keys.run_budget(run), "spent")) for run in (run_a, run_b)}
    assert spent == {run_a: 40, run_b: 40}

    a = redis.Redis.from_url(url_a)
    ref_b = AttemptRef(run=run_b, instance_id="i", attempt=1)
    for command in (("HSET", keys.run_budget(run_b), "spent", 0),  # zero another run's spend
                    ("HGET", keys.run_budget(run_b), "spent"),
                    ("DEL", keys.progress(ref_b)),
                    ("HSET", keys.attempt_budget(ref_b), "held", 0),
                    ("GET", keys.pool_state(pool)),  # the PoolPacer's own state
                    ("HSET", keys.run_live(run_b), "state", "finished"),  # the dashboard's
                    ("ZADD", keys.live_runs(), 1, run_a),
                    ("DEL", keys.run_hold(run_a)), ("SET", keys.run_hold(run_a), "0"),  # lift its own hold
                    ("GET", keys.run_hold(run_b))):  # nor read another run's
        with pytest.raises(redis.exceptions.NoPermissionError):
            a.execute_command(*command)
    script = "return redis.call('HSET', KEYS[1], 'spent', 0)"  # nor from inside a script
    with pytest.raises(redis.exceptions.NoPermissionError):
        a.eval(script, 1, keys.run_budget(run_b))
    with pytest.raises(redis.exceptions.ResponseError):  # a key it did not declare is checked too
        a.eval("return redis.call('HSET', '" + keys.run_budget(run_b) + "', 'spent', 0)", 0)
    for command in (("KEYS", "*"), ("SCAN", 0), ("FLUSHALL",), ("CONFIG", "GET", "*"), ("ACL", "LIST"),
                    ("SCRIPT", "FLUSH"), ("ACL", "SETUSER", valkey_auth.run_user(run_a), "~*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            a.execute_command(*command)
    assert int(valkey.hget(keys.run_budget(run_b), "spent")) == 40  # untouched
    assert a.hset(keys.run_budget(run_a), "probe", 1) == 1  # its own run's keys: yes


def test_removing_a_runs_user_ends_its_access(valkey, two_runs):
    _, runs = two_runs
    run, url = runs["a"]
    client = redis.Redis.from_url(url)
    assert client.ping()
    valkey_auth.remove_run_user(valkey, run)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url).ping()
