"""The dispatcher's Ray actors in a real local Ray cluster with its dashboard: the PoolPacer and the results
writer are listed by the dashboard's state API with their names, and a killed PoolPacer comes back with
its state reloaded from Valkey."""

import os
import signal
import time

import pytest
import ray
import redis

from contract import keys
from dispatcher.backends import resources
from dispatcher.driver import loop
from dispatcher.driver.actors import PoolPacer, ResultsWriterActor


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory, moto_endpoint, database_url):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    aws_env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "AWS_DEFAULT_REGION")}
    loop._agent_port_of_its_own()  # another session's Ray may hold the default one
    ray.init(address="local", num_cpus=2, include_dashboard=True, namespace="evalplane-test", log_to_driver=False,
             runtime_env={"env_vars": aws_env | {"DATABASE_URL": database_url}})
    yield aws_env
    ray.shutdown()


def test_dashboard_lists_the_actors_and_a_killed_pacer_reloads_from_valkey(ray_cluster, valkey_url, unique,
                                                                           database_url, pg, tmp_path):
    from psycopg.types.json import Jsonb
    from ray.util.state import list_actors

    pool = f"{unique}-pool"
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'local', 1)",
               (unique, Jsonb({})))
    pg.commit()
    res = resources.ensure(unique)
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    try:
        pacer = PoolPacer.options(name=f"pacer:{pool}", get_if_exists=True).remote(pool, valkey_url, {"rpm": 600})
        writer = ResultsWriterActor.options(name=f"results-writer:{unique}:0").remote(
            res.model_dump(), database_url, ray_cluster, 60.0, (str(tmp_path / "run.key"), str(tmp_path / "v.key")))
        assert ray.get(pacer.state_snapshot.remote())["limits"] == {"rpm": 600}
        assert ray.get(writer.state.remote())["alive"] is True
        # The shims saw two 429s from a provider whose headers say no limits: the pacer adapts and mirrors to Valkey
        # (where headers say them, it follows the headers instead: tests/dispatcher/test_pacing.py).
        r.hset(keys.pool_discovered(pool), mapping={keys.THROTTLED_FIELD: 2})
        state = ray.get(pacer.tick.remote())
        assert state["source"] == "adapted" and state["limits"]["rpm"] < 600
        assert int(r.hget(keys.pool_limits(pool), "rpm")) == state["limits"]["rpm"]

        # via the dashboard, of this cluster (named: other clusters may run on the host)
        alive = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")])
        names = {a.name: a for a in alive}
        assert f"pacer:{pool}" in names and f"results-writer:{unique}:0" in names
        assert names[f"pacer:{pool}"].class_name == "PoolPacer"

        pid = ray.get(pacer.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # the same handle reaches the restarted actor, whose state came back from Valkey
            try:
                again = ray.get(pacer.state_snapshot.remote(), timeout=30)
                break
            except ray.exceptions.RayActorError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert ray.get(pacer.__ray_call__.remote(lambda self: os.getpid())) != pid
        assert again["limits"] == state["limits"] and again["decreases"] == 1
        ray.get(writer.stop.remote())
    finally:
        for k in (keys.pool_limits(pool), keys.pool_state(pool), keys.pool_discovered(pool)):
            r.delete(k)
        resources.remove_queues(res)
