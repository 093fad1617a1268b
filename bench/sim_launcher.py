"""The `sim` launcher for the dispatch benchmark: simulated tasks that do to the control plane what real tasks do,
without running a harness.

Like real tasks, each signs its messages (the ledger batches, the result, the ledger copy) with its attempt's key,
handed to it at launch (the driver side's attempt_env, as dispatcher/driver/loop.py gives real launchers): the results
writer verifies them as it does a real fleet's.

Each task, from its launch, for its harness time: keeps its progress key alive in Valkey (as harness/task.py's
Heartbeat), makes CALLS_PER_TASK calls, whose ledger rows its shim sends to the results queue in `batches` batches
while it runs, and at its end sends its result carrying the rows not yet sent (the last call's), marks its progress
key "done" and exits 0. The tasks live in a process of their own (the fleet), so that their work is neither in the
driver's pass times nor in its memory; the driver side (SimLauncher) hands each launch to the fleet and learns the
exits from it. Two economies of the stand-in, not of real tasks: the fleet packs up to ten tasks' messages into one
SendMessageBatch call (contract.aws.send_batch: every entry checked), and tasks store no S3 copies, except the
`drop` tasks, whose result is killed on its way: they store their ledger copy, so that the driver lands them as
lost_result with every row.
"""

from __future__ import annotations

import heapq
import multiprocessing
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from contract import aws, keys, signing
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
from dispatcher.launchers.base import AttemptEnv, Launcher, LaunchMeter, TaskHandle, no_attempt_env

CALLS_PER_TASK = 10
DONE_TTL_S = 600  # as harness/task.py: the "result sent" mark


def call_rows(ref: AttemptRef, pool: str, model: str, rng: random.Random) -> list[CallRecord]:
    start = utcnow() - timedelta(seconds=60)
    rows = []
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
    return rows


def split_rows(rows: list[CallRecord], batches: int) -> tuple[list[list[CallRecord]], list[CallRecord]]:
    """The rows the shim sends in `batches` batches during the run, and the rest (the last call's at least), which
    ride with the result."""
    sent = rows[:-1] if batches else []
    k = min(batches, len(sent))
    groups = [sent[i * len(sent) // k:(i + 1) * len(sent) // k] for i in range(k)] if k else []
    return groups, rows[len(sent):]


def result_of(ref: AttemptRef, pool: str, model: str, rows: list[CallRecord], tail: list[CallRecord]) -> str:
    result = AttemptResult(
        ref=ref, harness="mini-swe-agent", pool=pool, model=model, outcome=HarnessOutcome.SUBMITTED,
        ledger_calls=len(rows), totals=Totals.of(rows), started_at=rows[0].started_at, ended_at=utcnow(),
        ledger=tail)
    return Envelope(msg=result).model_dump_json()


def messages(ref: AttemptRef, pool: str, model: str, rng: random.Random, batches: int = 0) -> list[str]:
    """Every results message one task sends, in order: its ledger batches, then its result."""
    rows = call_rows(ref, pool, model, rng)
    groups, tail = split_rows(rows, batches)
    return [Envelope(msg=LedgerBatch(ref=ref, rows=g)).model_dump_json() for g in groups] + [
        result_of(ref, pool, model, rows, tail)]


# ---------------------------------------------------------------- the fleet (its own process)


class _Task:
    __slots__ = ("drop", "end", "ended", "groups", "ref", "rows", "sign", "tail")

    def __init__(self, ref, rows, groups, tail, end, drop, sign: signing.Signer | None):
        self.ref, self.rows, self.groups, self.tail, self.end, self.drop = ref, rows, groups, tail, end, drop
        self.sign = sign  # the attempt key's signer, as harness/task.py and its shim make from their environment
        self.ended = False


class Fleet:
    """Simulated tasks on one clock: a heap of due events (start, heartbeat, ledger batch, end), their messages
    sent ten to a call by a few sender threads."""

    TICK_S = 0.05

    def __init__(self, conn, queue_url: str, bucket: str, pool: str, model: str, valkey_url: str, task_s: float,
                 batches: int, drop: set[str], expected: int, senders: int = 8):
        import redis

        self.conn, self.queue, self.bucket, self.pool, self.model = conn, queue_url, bucket, pool, model
        self.expected = expected  # tasks of the run: when that many are live at once, all are
        self.task_s, self.batches, self.drop = task_s, batches, drop
        self.valkey = redis.Redis.from_url(valkey_url)
        self.due: list[tuple[float, int, str, _Task, int]] = []
        self.seq = 0
        # (body, its signature, the task whose result it is)
        self.outgoing: deque[tuple[str, str | None, _Task | None]] = deque()
        self.sent: deque[_Task] = deque()  # results on the queue: marked done and reported exited by the loop
        self.pool_ = ThreadPoolExecutor(senders, thread_name_prefix="sim-send")
        self.inflight = 0
        self.failed: list[BaseException] = []  # a send that failed loudly ends the fleet loudly
        self.lock = threading.Lock()
        self.stats = {"launched": 0, "live": 0, "peak_live": 0, "ended": 0, "results_sent": 0, "messages_sent": 0,
                      "send_calls": 0, "send_busy_s": 0.0, "first_sent_at": None, "first_result_at": None, "last_result_at": None,
                      "all_live_at": None, "dropped": 0}

    def _at(self, t: float, kind: str, task: _Task, arg: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.due, (t, self.seq, kind, task, arg))

    def _launch(self, instance_id: str, attempt: int, run: str, env: dict[str, str]) -> None:
        ref = AttemptRef(run=run, instance_id=instance_id, attempt=attempt)
        key = env.get(signing.ATTEMPT_KEY_ENV)
        rng = random.Random(f"{instance_id}/{attempt}")
        rows = call_rows(ref, self.pool, self.model, rng)
        groups, tail = split_rows(rows, self.batches)
        now = time.monotonic()
        harness_s = self.task_s * rng.uniform(1.0, 1.25)
        task = _Task(ref, rows, groups, tail, now + harness_s, instance_id in self.drop,
                     signing.signer(key.encode()) if key else None)
        self._at(now, "start", task)
        for i in range(len(groups)):  # evenly over the harness time, each within the shim's 2 s of its calls
            self._at(now + harness_s * (i + 1) / (len(groups) + 1), "batch", task, i)
        self._at(task.end, "end", task)
        self.stats["launched"] += 1
        self.stats["live"] += 1
        self.stats["peak_live"] = max(self.stats["peak_live"], self.stats["live"])

    def _send(self, bodies: list[tuple[str, str | None, _Task | None]]) -> None:
        t = time.monotonic()
        signed = {b: sig for b, sig, _ in bodies if sig}  # ten tasks' messages a call, each with its own signature
        aws.send_batch(self.queue, [b for b, _, _ in bodies], sign=signed.__getitem__ if signed else None)
        done = time.time()
        with self.lock:
            self.inflight -= 1
            self.stats["send_calls"] += 1
            self.stats["messages_sent"] += len(bodies)
            self.stats["send_busy_s"] += time.monotonic() - t
            self.stats["first_sent_at"] = self.stats["first_sent_at"] or done
            for _, _, task in bodies:
                if task is not None:
                    self.sent.append(task)
                    self.stats["results_sent"] += 1
                    self.stats["first_result_at"] = self.stats["first_result_at"] or done
                    self.stats["last_result_at"] = done

    def _events(self, now: float) -> None:
        beats, starts = [], []
        while self.due and self.due[0][0] <= now:
            _, _, kind, task, arg = heapq.heappop(self.due)
            if task.ended:
                continue
            if kind == "start":
                starts.append(task)
                self._at(now + keys.PROGRESS_TTL_S / 4, "beat", task)
            elif kind == "beat":
                beats.append(task)
                self._at(now + keys.PROGRESS_TTL_S / 4, "beat", task)
            elif kind == "batch":
                self._out(task, Envelope(msg=LedgerBatch(ref=task.ref, rows=task.groups[arg])).model_dump_json())
            elif kind == "end":
                task.ended = True
                if task.drop:  # killed on its way: its ledger copy is in S3, its result nowhere
                    prefix = f"s3://{self.bucket}/runs/{task.ref.run}/attempts/{task.ref.instance_id}/{task.ref.attempt}/"
                    aws.put_text(aws.ledger_copy_uri(prefix), "".join(r.model_dump_json() + "\n" for r in task.rows),
                                 "application/x-ndjson", sign=task.sign)
                    self.stats["dropped"] += 1
                    self.sent.append(task)
                else:
                    self._out(task, result_of(task.ref, self.pool, self.model, task.rows, task.tail), result=True)
        if starts or beats:
            with self.valkey.pipeline(transaction=False) as p:
                for task in starts:
                    key = keys.progress(task.ref)
                    p.hset(key, mapping={"phase": "harness", "host": "sim"})
                    p.expire(key, keys.PROGRESS_TTL_S)
                for task in beats:
                    p.expire(keys.progress(task.ref), keys.PROGRESS_TTL_S)
                p.execute()

    def _out(self, task: _Task, body: str, result: bool = False) -> None:
        self.outgoing.append((body, task.sign(body) if task.sign else None, task if result else None))

    def _flush(self) -> None:
        while self.outgoing:
            group = [self.outgoing.popleft() for _ in range(min(10, len(self.outgoing)))]
            with self.lock:
                self.inflight += 1
            self.pool_.submit(self._send, group).add_done_callback(
                lambda f: f.exception() and self.failed.append(f.exception()))

    def _finish(self) -> list[tuple[str, int, int]]:
        """Results on the queue: as a real task, mark them sent (progress key "done"), then exit 0."""
        with self.lock:
            done = list(self.sent)
            self.sent.clear()
        if not done:
            return []
        with self.valkey.pipeline(transaction=False) as p:
            for task in done:
                key = keys.progress(task.ref)
                p.hset(key, mapping={"phase": "done", "outcome": "submitted"})
                p.expire(key, DONE_TTL_S)
            p.execute()
        self.stats["live"] -= len(done)
        self.stats["ended"] += len(done)
        return [(t.ref.instance_id, t.ref.attempt, 0) for t in done]

    def run(self) -> None:
        last_stats = 0.0
        while True:
            if self.failed:
                raise self.failed[0]
            while self.conn.poll(0):
                msg = self.conn.recv()
                if msg[0] == "quit":
                    self.pool_.shutdown(wait=True)
                    self.conn.send(("closed", None))
                    return
                for instance_id, attempt, run, env in msg[1]:
                    self._launch(instance_id, attempt, run, env)
            now = time.monotonic()
            self._events(now)
            self._flush()
            exits = self._finish()
            if exits:
                self.conn.send(("exit", exits))
            if self.stats["all_live_at"] is None and self.stats["live"] and self.stats["live"] == self.expected:
                self.stats["all_live_at"] = time.time()
            if now - last_stats >= 1.0:
                self.conn.send(("stats", dict(self.stats, queued=len(self.outgoing), inflight=self.inflight)))
                last_stats = now
            time.sleep(self.TICK_S)


def _fleet_main(conn, env: dict[str, str], kwargs: dict, fleet=Fleet) -> None:
    import os

    os.environ.update(env)
    fleet(conn, **kwargs).run()


class FleetLauncher(Launcher):
    """The driver's side of a fleet process: each launch goes to the fleet (in batches, once a pass), and poll
    answers from the exits the fleet reports ("exit", [(instance_id, attempt, code)]); ("stats", dict) messages
    update `stats`. `fleet(conn, **kwargs).run()` runs in the fleet process (spawned: picklable arguments)."""

    def __init__(self, fleet, kwargs: dict, env: dict, attempt_env: AttemptEnv = no_attempt_env):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_fleet_main, daemon=True, args=(child, env, kwargs, fleet))
        self.proc.start()
        self.codes: dict[str, int] = {}
        self.pending: list[tuple] = []
        self.attempt_env = attempt_env
        self.stats: dict = {}
        self.launched = 0
        self.meter = LaunchMeter()
        self._drained = 0.0

    def item(self, ref: AttemptRef, job_uri: str) -> tuple:
        """What the fleet gets for one launch."""
        return ref.instance_id, ref.attempt, ref.run, self.attempt_env(ref)

    def launch(self, ref: AttemptRef, job_uri: str, image: str | None = None) -> TaskHandle:
        with self.meter.timed():
            self.pending.append(self.item(ref, job_uri))
            self.launched += 1
            if len(self.pending) >= 64:
                self.flush()
        return TaskHandle(ref=ref, task_id=f"{ref.instance_id}/{ref.attempt}")

    def flush(self) -> None:
        if self.pending:
            self.conn.send(("launch", self.pending))
            self.pending = []

    def drain(self) -> None:
        self.flush()
        while self.conn.poll(0):
            self._received(*self.conn.recv())

    def _received(self, kind: str, body) -> None:
        if kind == "exit":
            self.codes.update((f"{i}/{a}", code) for i, a, code in body)
        elif kind == "stats":
            self.stats = body
        else:
            self.on_message(kind, body)

    def on_message(self, kind: str, body) -> None:
        """A message of the fleet's own kind."""

    def poll(self, handle: TaskHandle) -> int | None:
        now = time.monotonic()
        if now - self._drained > 0.1:
            self._drained = now
            self.drain()
        return self.codes.get(handle.task_id)

    def stop(self, handle: TaskHandle) -> None:
        pass  # simulated tasks end on their own, within their harness time

    def task_url(self, url: str) -> str:
        return url

    def launch_report(self) -> str:
        return f"{type(self).__name__}: {self.meter.report()}"

    def close(self) -> None:
        self.drain()
        self.conn.send(("quit",))
        # the fleet's last reports (of tasks that ended as the run did) come before it says it has closed
        deadline = time.monotonic() + 30
        while self.proc.is_alive() and time.monotonic() < deadline:
            if self.conn.poll(0.1):
                kind, body = self.conn.recv()
                if kind == "closed":
                    break
                self._received(kind, body)
        self.proc.join(30)


class SimLauncher(FleetLauncher):
    """Simulated tasks of the dispatch benchmark (Fleet)."""

    def __init__(self, results_queue_url: str, bucket: str, pool: str, model: str, valkey_url: str, env: dict,
                 task_s: float, batches: int = 3, drop: set[str] = frozenset(), expected: int = 0,
                 attempt_env: AttemptEnv = no_attempt_env):
        """attempt_env(ref): what one attempt's task gets besides the run's environment (its attempt key), as a
        real launcher's."""
        super().__init__(Fleet, {
            "queue_url": results_queue_url, "bucket": bucket, "pool": pool, "model": model, "valkey_url": valkey_url,
            "task_s": task_s, "batches": batches, "drop": set(drop), "expected": expected}, env, attempt_env)
