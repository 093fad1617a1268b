"""The `sim` launcher for the dispatch benchmark: tasks that send realistic result and ledger messages
(10 calls each) to the run's results queue after a short simulated run, without running a harness."""

from __future__ import annotations

import heapq
import random
import threading
import time
from datetime import timedelta

from contract import aws, keys
from contract.models import (
    AttemptRef,
    AttemptResult,
    CallRecord,
    Envelope,
    HarnessOutcome,
    LedgerBatch,
    Totals,
    utcnow,
)
from dispatcher.launchers.base import TaskHandle

CALLS_PER_TASK = 10


def messages(ref: AttemptRef, pool: str, model: str, rng: random.Random, split: bool = False) -> list[str]:
    rows = []
    start = utcnow() - timedelta(seconds=60)
    for seq in range(1, CALLS_PER_TASK + 1):
        inp, cached, out = rng.randint(500, 4000), rng.randint(0, 30000), rng.randint(50, 800)
        rows.append(CallRecord(
            run=ref.run, instance_id=ref.instance_id, attempt=ref.attempt, seq=seq, pool=pool, provider="anthropic",
            model=model, route="/v1/messages", stream=True, started_at=start + timedelta(seconds=6 * seq),
            input_tokens=inp, cached_tokens=cached, cache_write_tokens=rng.randint(0, 500), output_tokens=out,
            cost_usd=round(inp * 3e-6 + cached * 3e-7 + out * 1.5e-5, 9), latency_ms=rng.uniform(800, 9000),
            pacer_wait_ms=rng.uniform(0, 50), retries=rng.choice((0, 0, 0, 1)), http_status=200, outcome="ok",
            raw_usage={"input_tokens": inp, "cache_read_input_tokens": cached, "output_tokens": out},
        ))
    result = AttemptResult(
        ref=ref, harness="mini-swe-agent", pool=pool, model=model, outcome=HarnessOutcome.SUBMITTED,
        ledger_calls=len(rows), totals=Totals.of(rows), started_at=start, ended_at=utcnow(),
    )
    if split:  # a long task: its shim sent the rows in a batch during the run
        return [Envelope(msg=LedgerBatch(ref=ref, rows=rows)).model_dump_json(), Envelope(msg=result).model_dump_json()]
    # a task whose calls all came within the shim's last send interval: they ride with the result
    return [Envelope(msg=result.model_copy(update={"ledger": rows})).model_dump_json()]


class SimLauncher:
    """Each task 'runs' for about task_s (a due time, not a sleeping thread), then sends its result carrying its
    ledger rows (or, split, a ledger batch and the result in one SendMessageBatch), as a real task does at its end. A few sender threads play the tasks."""

    def __init__(self, results_queue_url: str, pool: str, model: str, task_s: float = 0.5, threads: int = 8,
                 valkey=None, split: bool = False):
        self.split = split
        self.queue, self.pool_name, self.model, self.task_s = results_queue_url, pool, model, task_s
        self.valkey = valkey
        self.due: list[tuple[float, str, AttemptRef]] = []
        self.cv = threading.Condition()
        self.done: dict[str, int] = {}
        self.launched = 0
        self.threads = [threading.Thread(target=self._sender, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _sender(self) -> None:
        sqs = aws.client("sqs")
        while True:
            with self.cv:
                while not self.due or self.due[0][0] > time.monotonic():
                    self.cv.wait(timeout=None if not self.due else max(0.0, self.due[0][0] - time.monotonic()))
                _, task_id, ref = heapq.heappop(self.due)
            bodies = messages(ref, self.pool_name, self.model, random.Random(task_id), self.split)
            sqs.send_message_batch(QueueUrl=self.queue,
                                   Entries=[{"Id": str(i), "MessageBody": b} for i, b in enumerate(bodies)])
            if self.valkey is not None:  # as a real task does: its result is on the queue
                key = keys.progress(ref)
                self.valkey.hset(key, mapping={"phase": "done", "outcome": "submitted"})
                self.valkey.expire(key, 600)
            self.done[task_id] = 0

    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        task_id = f"sim-{ref.instance_id}-{ref.attempt}"
        self.launched += 1
        with self.cv:
            heapq.heappush(self.due, (time.monotonic() + self.task_s * random.uniform(0.5, 1.5), task_id, ref))
            self.cv.notify()
        return TaskHandle(ref=ref, task_id=task_id)

    def poll(self, handle: TaskHandle) -> int | None:
        return self.done.get(handle.task_id)

    def stop(self, handle: TaskHandle) -> None:
        pass

    def task_url(self, url: str) -> str:
        return url
