"""The ledger: one contract.models.CallRecord per call, appended to a local JSONL file (one write(2) per row,
before anything else runs) and shipped to the results queue as LedgerBatch envelopes by boto3, in a thread.
A row leaves `pending` only once its batch was accepted."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from contract.models import AttemptRef, CallRecord, Totals

log = logging.getLogger("shim.ledger")

MAX_MESSAGE_BYTES = 240_000  # SQS allows 256 KiB; keep a margin


class SQSSender:
    """boto3's SQS client, made on first use (in the sender's thread). Endpoint: boto3's own settings
    (AWS_ENDPOINT_URL_SQS / AWS_ENDPOINT_URL); region: AWS_REGION, AWS_DEFAULT_REGION, else the queue URL's."""

    def __init__(self, queue_url: str):
        from shim.config import ledger_signer

        self.queue_url = queue_url
        self.sign = ledger_signer()  # the attempt's key: the results writer lands no batch without its signature
        self._client = None
        self._lock = threading.Lock()

    def client(self):
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                host = urlparse(self.queue_url).hostname or ""
                region = (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                          or (host.split(".")[1] if host.startswith("sqs.") else "us-east-1"))
                # short timeouts: a shutdown waits for a send in flight
                config = Config(connect_timeout=5, read_timeout=15, retries={"mode": "standard", "max_attempts": 3})
                self._session = boto3.session.Session(region_name=region)
                self._client = self._session.client("sqs", config=config)
            return self._client

    def warm(self) -> None:
        """Load boto3 and resolve the credentials (the container endpoint on ECS) while the shim is idle."""
        self.client()
        credentials = self._session.get_credentials()  # the client's own (botocore caches them on the session)
        if credentials is not None:
            credentials.get_frozen_credentials()

    def __call__(self, body: str) -> None:
        """Sent only once SQS has stored exactly this body (else the rows stay pending and go again)."""
        from contract.aws import (  # botocore with it: off the start-up path
            SendFailed,
            md5_of,
            signature_attributes,
        )

        attrs = signature_attributes(body, self.sign)
        got = self.client().send_message(QueueUrl=self.queue_url, MessageBody=body,
                                         **({"MessageAttributes": attrs} if attrs else {})).get("MD5OfMessageBody")
        if got != md5_of(body):
            raise SendFailed(f"{self.queue_url}: SQS stored a body whose MD5 is {got}, not the one sent")


class Ledger:
    def __init__(self, path: Path, ref: AttemptRef, queue_url: str | None = None, batch_size: int = 200,
                 interval_s: float = 2.0, sender: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.ref = ref
        self.queue_url = queue_url
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.sender = sender or (SQSSender(queue_url) if queue_url else None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq = self._existing_rows()  # a restarted shim continues the numbering
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rows = 0  # rows written by this process
        self.sent = 0  # rows accepted by the queue
        self.pending: list[str] = []  # rows as JSON
        self.pending_seqs: list[int] = []  # their seqs (the status names the unsent ones at exit)
        self.totals = Totals()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sqs")
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

    def append(self, **fields: Any) -> CallRecord:
        """Number the row, write it durably, queue it for sending."""
        self.seq += 1
        row = CallRecord(run=self.ref.run, instance_id=self.ref.instance_id, attempt=self.ref.attempt, seq=self.seq,
                         **fields)
        text = row.model_dump_json()
        data = (text + "\n").encode()
        n = os.write(self._fd, data)
        while n < len(data):  # a short write (a full disk, a signal): the rest, or OSError
            n += os.write(self._fd, data[n:])
        self.rows += 1
        self.totals.add(row.usage, row.cost_usd)
        if self.queue_url:
            self.pending.append(text)
            self.pending_seqs.append(self.seq)
            if len(self.pending) >= self.batch_size:
                self._wake.set()
        return row

    def start(self) -> asyncio.Future | None:
        """Start sending; with SQS, make its client in a thread now (the future of that)."""
        if not self.queue_url or self._task is not None:
            return None
        self._task = asyncio.create_task(self._run(), name="ledger-sender")
        if not isinstance(self.sender, SQSSender):
            return None
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self.sender.warm)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                              or log.warning("SQS client warm-up failed: %s", type(f.exception()).__name__))
        return fut

    async def _run(self) -> None:
        while not self._stopping:
            full_only = True  # woken by a full batch: a partial one waits for its interval
            delay = min(self.interval_s * 2 ** min(self._failures, 5), 30.0) if self._failures else self.interval_s
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            except TimeoutError:
                full_only = False
            self._wake.clear()
            if not self._stopping:
                await self.flush(full_only)

    async def flush(self, full_only: bool = False) -> bool:
        """Send what is pending (only whole batches if full_only); False if a send failed (rows stay pending)."""
        if not self.queue_url:
            return True
        async with self._lock:
            while self.pending and (len(self.pending) >= self.batch_size or not full_only):
                n = min(self.batch_size, len(self.pending))
                while len(body := self._envelope(self.pending[:n])) > MAX_MESSAGE_BYTES and n > 1:
                    n = max(1, n // 2)
                try:
                    await asyncio.get_running_loop().run_in_executor(self._pool, self.sender, body)
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
        return '{"msg":{"kind":"ledger","ref":' + self.ref.model_dump_json() + ',"rows":[' + ",".join(rows) + "]}}"

    async def close(self, timeout_s: float = 30.0, send: bool = True) -> bool:
        """Stop the sender, send what is left (retrying until timeout; or, send=False, leave it for the task to
        send with the attempt's result: `pending_seqs` names it), close the file."""
        if self._task is not None:
            self._stopping = True  # an in-flight send finishes (cancelling it could send a batch twice)
            self._wake.set()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        ok = True
        if send:
            ok = await self.flush()
            deadline, delay = time.monotonic() + timeout_s, 0.2
            while not ok and time.monotonic() < deadline:
                await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, 5.0)
                ok = await self.flush()
            if not ok:
                log.error("%d ledger rows could not be sent; they remain in %s", len(self.pending), self.path)
        os.close(self._fd)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return ok
