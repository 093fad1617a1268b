"""Ray actors of the dispatcher: the results writer and one PoolPacer per pool.

They are thin: the logic lives in plain classes (ResultsWriter, PoolLimits) that tests use without Ray;
the actors give them a process of their own, a name in the Ray dashboard, and restartability.
"""

from __future__ import annotations

import threading

import ray
import redis

from contract import keys
from dispatcher.resources import RunResources
from dispatcher.writer import ResultsWriter


@ray.remote(max_restarts=-1, max_task_retries=-1)
class ResultsWriterActor:
    """Consumes one run's results queue until stopped; its counters show in the dashboard."""

    def __init__(self, res: dict, database_url: str, aws_env: dict[str, str], eval_timeout_s: float):
        import os

        os.environ.update(aws_env)
        self.writer = ResultsWriter(RunResources.model_validate(res), database_url, eval_timeout_s)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.writer.run_until, args=(self.stop_event,), daemon=True)
        self.thread.start()

    def state(self) -> dict:
        return self.writer.state() | {"alive": self.thread.is_alive()}

    def drain(self) -> int:
        """Land whatever is on the queue now (used at the end of a run)."""
        total = 0
        while n := self.writer.poll_once(wait_s=0):
            total += n
        return total

    def stop(self) -> dict:
        self.stop_event.set()
        self.thread.join(timeout=10)
        return self.state()


@ray.remote(max_restarts=-1, max_task_retries=-1)
class PoolPacer:
    """Owns one pool's limits: loads them from Valkey on (re)start, mirrors changes back for the shims."""

    def __init__(self, pool: str, valkey_url: str, initial: dict[str, int]):
        self.pool = pool
        self.r = redis.Redis.from_url(valkey_url, decode_responses=True)
        stored = self.r.hgetall(keys.pool_limits(pool))
        self.limits = {k: int(v) for k, v in stored.items()} or {k: v for k, v in initial.items() if v}
        if self.limits:
            self.r.hset(keys.pool_limits(pool), mapping=self.limits)

    def state(self) -> dict:
        return {"pool": self.pool, "limits": self.limits, "discovered": self.r.hgetall(keys.pool_discovered(self.pool))}
