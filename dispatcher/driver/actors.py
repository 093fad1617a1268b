"""Ray actors of the dispatcher: the results writer and one PoolPacer per pool.

They are thin: the logic lives in plain classes (ResultsWriter, PoolLimits) that tests use without Ray;
the actors give them a process of their own, a name in the Ray dashboard, and restartability.
"""

from __future__ import annotations

import threading
import time

import ray
import redis

from contract import keys
from contract.signing import RunKeys
from dispatcher.backends.resources import RunResources
from dispatcher.driver.pacing import PacerPolicy, PacerState
from dispatcher.driver.writer import ResultsWriter


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class ResultsWriterActor:
    """Consumes one run's results queue until stopped; its counters show in the dashboard."""

    def __init__(self, res: dict, database_url: str, aws_env: dict[str, str], eval_timeout_s: float,
                 key_files: tuple[str, str]):
        """key_files: the run secret's and the verdict key's 0600 files (paths, not keys: actor arguments are
        stored in Ray's GCS)."""
        import os

        os.environ.update(aws_env)
        self.writer = ResultsWriter(RunResources.model_validate(res), database_url, eval_timeout_s,
                                    keys=RunKeys.load(*key_files))
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


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class PoolPacer:
    """Owns one pool's limits: reloads its state from Valkey on (re)start, adapts, mirrors to the shims' key.

    Named `pacer:<pool>` in the `evalplane` namespace (get-if-exists), so two runs on one pool share it.
    """

    def __init__(self, pool: str, valkey_url: str, spec_limits: dict[str, int | None]):
        from ray.util.metrics import Gauge

        self.pool = pool
        self.policy = PacerPolicy()
        self.r = redis.Redis.from_url(valkey_url, decode_responses=True)
        stored = self.r.get(keys.pool_state(pool))
        self.state = PacerState.model_validate_json(stored) if stored else self.policy.initial(spec_limits)
        self.gauge = Gauge("evalplane_pool_limit", description="limit the shims pace against",
                           tag_keys=("pool", "dimension"))
        self._save()

    def _save(self) -> None:
        with self.r.pipeline() as p:
            p.set(keys.pool_state(self.pool), self.state.model_dump_json())
            p.delete(keys.pool_limits(self.pool))
            if self.state.limits:
                p.hset(keys.pool_limits(self.pool), mapping=self.state.limits)
            p.execute()
        for dim, value in self.state.limits.items():
            self.gauge.set(value, tags={"pool": self.pool, "dimension": dim})

    def tick(self) -> dict:
        """Read what the shims discovered and observed, adapt, publish. Called by the driver every few seconds."""
        seen = self.r.hgetall(keys.pool_discovered(self.pool))
        throttled = int(seen.pop(keys.THROTTLED_FIELD, 0) or 0)
        new = self.policy.tick(self.state, seen, throttled, time.time())
        if new != self.state:
            self.state = new
            self._save()
        return self.state.model_dump()

    def state_snapshot(self) -> dict:
        return {"pool": self.pool, **self.state.model_dump()}
