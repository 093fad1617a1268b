"""The ledger: one CallRecord per call, appended to a local JSONL file (flushed per call) and shipped to
the results queue as LedgerBatch envelopes. A row leaves `pending` only once its batch was accepted.

Rows are plain dicts with contract.models.CallRecord's fields, serialised to its JSON shape (call_id and
started_at as strings); no pydantic in the shim (the results writer validates them on landing, and the tests
check that every row parses as a CallRecord and every message as an Envelope).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shim.wire import dumps

log = logging.getLogger("shim.ledger")

MAX_MESSAGE_BYTES = 240_000  # SQS allows 256 KiB; keep a margin


TOTAL_FIELDS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")


class Totals:
    """contract.models.Totals' fields, summed as rows are written."""

    __slots__ = ("cache_write_tokens", "cached_tokens", "calls", "cost_usd", "input_tokens", "output_tokens")

    def __init__(self) -> None:
        self.calls = self.input_tokens = self.cached_tokens = self.cache_write_tokens = self.output_tokens = 0
        self.cost_usd = 0.0

    def model_dump(self) -> dict[str, Any]:
        return {"calls": self.calls, "input_tokens": self.input_tokens, "cached_tokens": self.cached_tokens,
                "cache_write_tokens": self.cache_write_tokens, "output_tokens": self.output_tokens,
                "cost_usd": self.cost_usd}


_sqs = None
_sqs_lock = threading.Lock()


def _sqs_client():
    """The SQS sender (shim.sqs: stdlib only, no botocore), made once, only when a results queue is configured."""
    global _sqs
    with _sqs_lock:  # the warm-up thread and the first send may race
        if _sqs is None:
            from shim.sqs import SQSSender

            _sqs = SQSSender()
    return _sqs


def _default_sender(queue_url: str, body: str) -> None:
    _sqs_client().send(queue_url, body)


def _warm_default_sender() -> None:
    """Make the sender and fetch its credentials (from the container endpoint on ECS) while the shim is idle."""
    _sqs_client().credentials()


class Ledger:
    def __init__(
        self,
        path: Path,
        ref,
        queue_url: str | None = None,
        batch_size: int = 25,
        interval_s: float = 2.0,
        sender: Callable[[str, str], None] | None = None,
    ):
        self.path = Path(path)
        self.ref = ref
        self.queue_url = queue_url
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.sender = sender or _default_sender
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq = self._existing_rows()  # a restarted shim continues the numbering
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # closed by close()
        self.rows = 0  # rows written by this process
        self.sent = 0  # rows accepted by the queue
        self.pending: list[str] = []  # rows as JSON
        self.pending_seqs: list[int] = []  # their seqs (the shim's status names the unsent ones at exit)
        self.totals = Totals()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failures = 0
        self._stopping = False

    def _existing_rows(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return sum(1 for line in f if line.strip())
        except FileNotFoundError:
            return 0

    # ------------------------------------------------------------ writing

    def append(self, row: dict[str, Any]) -> dict[str, Any]:
        """Number the row (a CallRecord-shaped dict), write it durably, queue it for sending."""
        self.seq += 1
        row["seq"] = self.seq
        data = dumps(row) + b"\n"
        n = os.write(self._fd, data)  # one write(2) per row: in the file before anything else runs
        while n < len(data):  # a short write (a full disk, a signal): the rest, or OSError
            n += os.write(self._fd, data[n:])
        self.rows += 1
        t = self.totals
        t.calls += 1
        t.input_tokens += row["input_tokens"]
        t.cached_tokens += row["cached_tokens"]
        t.cache_write_tokens += row["cache_write_tokens"]
        t.output_tokens += row["output_tokens"]
        t.cost_usd = round(t.cost_usd + row["cost_usd"], 9)
        if self.queue_url:
            self.pending.append(data[:-1].decode())
            self.pending_seqs.append(self.seq)
            if len(self.pending) >= self.batch_size:
                self._wake.set()
        return row

    # ------------------------------------------------------------ shipping

    def start(self) -> None:
        if self.queue_url and self._task is None:
            self._task = asyncio.create_task(self._run(), name="ledger-sender")

    def warm(self) -> None:
        """With a results queue: make the SQS sender and resolve its credentials in a thread now (the shim is
        ready and idle), not at the first batch, in the middle of calls."""
        if self.queue_url and self.sender is _default_sender:
            fut = asyncio.get_running_loop().run_in_executor(None, _warm_default_sender)
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                  or log.warning("SQS client warm-up failed: %s", type(f.exception()).__name__))

    async def _run(self) -> None:
        while not self._stopping:
            full_only = True  # woken by a full batch: a partial one waits for its interval
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._delay())
            except TimeoutError:
                full_only = False
            self._wake.clear()
            if self._stopping:
                break
            await self.flush(full_only)

    def _delay(self) -> float:
        if self._failures:
            return min(self.interval_s * (2 ** min(self._failures, 5)), 30.0)
        return self.interval_s

    async def flush(self, full_only: bool = False) -> bool:
        """Send what is pending (only whole batches if full_only); False if a send failed (rows stay pending)."""
        if not self.queue_url:
            return True
        async with self._lock:
            while self.pending and (len(self.pending) >= self.batch_size or not full_only):
                n = min(self.batch_size, len(self.pending))
                while True:
                    body = self._envelope(self.pending[:n])
                    if len(body) <= MAX_MESSAGE_BYTES or n == 1:
                        break
                    n = max(1, n // 2)
                try:
                    await asyncio.to_thread(self.sender, self.queue_url, body)
                except Exception as e:  # noqa: BLE001 - whatever the queue client raised, the rows stay pending
                    self._failures += 1
                    log.warning("ledger batch send failed (%d pending): %s", len(self.pending), type(e).__name__)
                    return False
                del self.pending[:n]
                del self.pending_seqs[:n]
                self.sent += n
                self._failures = 0
        return True

    def _envelope(self, rows: list[str]) -> str:
        """contract.models.Envelope(msg=LedgerBatch(ref, rows)) as JSON, from rows already serialised."""
        ref = json.dumps({"run": self.ref.run, "instance_id": self.ref.instance_id, "attempt": self.ref.attempt},
                         separators=(",", ":"))
        return '{"msg":{"kind":"ledger","ref":' + ref + ',"rows":[' + ",".join(rows) + "]}}"

    async def close(self, timeout_s: float = 30.0, send: bool = True) -> bool:
        """Stop the sender, send what is left (retrying until timeout; or, send=False, leave it for the task to
        send with the attempt's result: `pending_seqs` names it), close the file."""
        if self._task is not None:
            # let an in-flight send finish (cancelling it could send a batch twice)
            self._stopping = True
            self._wake.set()
            try:
                await self._task
            except Exception as e:  # noqa: BLE001 - flush() below retries what the sender left pending
                log.debug("ledger sender ended with %s", type(e).__name__)
            self._task = None
        if not send:
            os.close(self._fd)
            return True
        ok = await self.flush()
        deadline = time.monotonic() + timeout_s
        delay = 0.2
        while not ok and time.monotonic() < deadline:
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 5.0)
            ok = await self.flush()
        os.close(self._fd)
        if not ok:
            log.error("%d ledger rows could not be sent; they remain in %s", len(self.pending), self.path)
        return ok
