"""A small asyncio Valkey client for the shim: one pipelined connection, RESP parsed by hiredis.

Why not redis-py's asyncio client on the hot path: importing it costs ~38 MB of RSS and ~0.3 s (it pulls in
its OpenTelemetry observability layer), and each command goes through a connection pool and several layers of
Python. The shim needs only a few things: EVALSHA of a handful of scripts (reloaded on NOSCRIPT), a pipeline
of a few commands in one round trip, and HSET/EXPIRE. All callers share one connection: requests are written
in order and replies come back in order (RESP), so concurrent calls pipeline by themselves.

`as_kv(client)` wraps a redis-py client (tests and benchmarks share one between many shims) behind the same
interface, so ValkeyPacer / ValkeyBudget / Progress work with either.

Errors: a command's error reply is raised as ReplyError (in a pipeline it is returned in its slot). A lost or
refused connection raises ConnectionError; the call is retried on a new connection (4 retries, exponential
backoff capped at 1 s, as the redis-py client was configured). A reply that takes longer than
`socket_timeout_s` fails every request on the connection with TimeoutError and drops the connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl as _ssl
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import hiredis


class ReplyError(Exception):
    """An error reply from Valkey (hiredis returns these in place of a reply)."""


def is_noscript(e: object) -> bool:
    return isinstance(e, Exception) and str(e).startswith("NOSCRIPT")


class Script:
    __slots__ = ("sha", "text")

    def __init__(self, text: str):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def cmd(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


class _Conn(asyncio.Protocol):
    """One connection. Each request is [replies expected, replies so far, future, sent at]; replies come back
    in order, so the first waiter's replies are the next ones read."""

    __slots__ = ("closed", "reader", "transport", "waiters")

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=ReplyError)
        self.waiters: deque[list] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        waiters = self.waiters
        while True:
            reply = reader.gets()
            if reply is False:
                return
            if not waiters:  # a reply nobody asked for: the stream is out of step, drop it
                self._fail(ConnectionError("unexpected reply from Valkey"))
                return
            w = waiters[0]
            w[1].append(reply)
            if len(w[1]) == w[0]:
                waiters.popleft()
                if not w[2].done():
                    w[2].set_result(w[1])

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._fail(ConnectionError("Valkey connection lost"))

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        while self.waiters:
            fut = self.waiters.popleft()[2]
            if not fut.done():
                fut.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def send(self, payload: bytes, requests: Iterable[tuple[int, asyncio.Future]]) -> None:
        now = time.monotonic()
        self.waiters.extend([n, [], fut, now] for n, fut in requests)
        self.transport.write(payload)


class KV:
    """The shim's Valkey client (see the module docstring). `url`: redis:// or rediss:// [user:pass@] host:port/db."""

    def __init__(self, url: str, socket_timeout_s: float = 5.0, connect_timeout_s: float = 5.0,
                 retries: int = 4, defer_s: float = 0.005):
        u = urlparse(url)
        if u.scheme not in ("redis", "rediss"):
            raise ValueError(f"unsupported Valkey URL scheme {u.scheme!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 6379
        self.db = int((u.path or "/0").lstrip("/") or 0)
        self.username = unquote(u.username) if u.username else None
        self.password = unquote(u.password) if u.password else None
        self.ssl: _ssl.SSLContext | None = None
        if u.scheme == "rediss":
            self.ssl = _ssl.create_default_context()
            reqs = (parse_qs(u.query).get("ssl_cert_reqs") or ["required"])[0].lower()
            if reqs in ("none", "optional"):
                self.ssl.check_hostname = False
                self.ssl.verify_mode = _ssl.CERT_NONE if reqs == "none" else _ssl.CERT_OPTIONAL
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self._conn: _Conn | None = None
        self._connecting: asyncio.Future | None = None
        self._scripts: dict[str, str] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self.defer_s = defer_s
        self._queue: list[tuple[bytes, int, asyncio.Future]] = []  # (payload, replies, future of the replies)
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it is used from (get_running_loop() is a
        # getpid(2) on Python 3.11: kept, not asked per command)

    # ------------------------------------------------------------ connection

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Conn, self.host, self.port, ssl=self.ssl), self.connect_timeout_s
        )
        hello: list[tuple] = []
        if self.password is not None:
            hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        if hello:
            fut = loop.create_future()
            conn.send(b"".join(hiredis.pack_command(c) for c in hello), [(len(hello), fut)])
            replies = await asyncio.wait_for(fut, self.connect_timeout_s)
            for r in replies:
                if isinstance(r, Exception):
                    conn._fail(ConnectionError(f"Valkey handshake failed: {r}"))
                    raise ConnectionError(f"Valkey handshake failed: {r}")
        if self._watchdog is None:
            self._watchdog = loop.call_later(1.0, self._watch)
        return conn

    async def _get(self) -> _Conn:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._connecting is None:  # one connect at a time; concurrent callers wait for it
            self._connecting = asyncio.ensure_future(self._connect())
        fut = self._connecting
        try:
            conn = await asyncio.shield(fut)
        finally:
            if self._connecting is fut and fut.done():
                self._connecting = None
        self._conn = conn
        return conn

    def _watch(self) -> None:
        """Once a second: a connection whose oldest request waited past the socket timeout is dropped."""
        conn = self._conn
        if (conn is not None and conn.waiters and not conn.closed
                and time.monotonic() - conn.waiters[0][3] > self.socket_timeout_s):
            conn._fail(TimeoutError("Valkey did not answer in time"))
        self._watchdog = asyncio.get_running_loop().call_later(1.0, self._watch)

    async def aclose(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None

    # ------------------------------------------------------------ commands

    async def _send(self, cmds: Sequence[tuple], defer: bool = False) -> list[Any]:
        """Send commands, return their replies (error replies as exceptions, in their slots).

        defer=True: not urgent (settles, progress). The commands wait up to `defer_s` and go out with the next
        urgent request (one write, one round trip) or on their own when the timer fires: fewer syscalls and
        round trips per call when calls overlap, and never on a call's critical path."""
        payload = hiredis.pack_command(cmds[0]) if len(cmds) == 1 else b"".join(
            [hiredis.pack_command(c) for c in cmds])
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        delay = 0.05
        for attempt in range(self.retries + 1):
            fut = loop.create_future()
            self._queue.append((payload, len(cmds), fut))
            if defer and attempt == 0:
                if self._timer is None:
                    self._timer = loop.call_later(self.defer_s, self._kick)
            else:
                await self._flush()
            try:
                return await fut
            except (ConnectionError, OSError, TimeoutError):
                if attempt == self.retries:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    def kick(self) -> None:
        """Send deferred commands now (someone waits for their replies)."""
        if self._timer is not None:
            self._timer.cancel()
            self._kick()

    def _kick(self) -> None:
        self._timer = None
        if self._queue:
            conn = self._conn
            if conn is not None and not conn.closed:
                self._write(conn)
            else:
                asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        """Write everything queued (deferred commands ride along with an urgent one)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            conn = await self._get()
        except (ConnectionError, OSError, TimeoutError) as e:
            batch, self._queue = self._queue, []
            err = e if isinstance(e, (ConnectionError, TimeoutError)) else ConnectionError(str(e))
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        if self._queue:
            self._write(conn)

    def _write(self, conn: _Conn) -> None:
        batch, self._queue = self._queue, []
        if len(batch) == 1:
            payload, n, fut = batch[0]
            conn.send(payload, ((n, fut),))
        else:
            conn.send(b"".join([b[0] for b in batch]), [(b[1], b[2]) for b in batch])

    async def execute(self, *args: Any) -> Any:
        (reply,) = await self._send([args])
        if isinstance(reply, Exception):
            raise reply
        return reply

    def register(self, script: Script) -> Script:
        self._scripts[script.sha] = script.text
        return script

    async def script(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        self._scripts.setdefault(script.sha, script.text)
        (reply,) = await self._send([script.cmd(keys, args)])
        if isinstance(reply, Exception):
            if not is_noscript(reply):
                raise reply
            return await self.execute("EVAL", script.text, len(keys), *keys, *args)  # loads it too
        return reply

    async def pipeline(self, cmds: Sequence[tuple], transaction: bool = False, defer: bool = False) -> list[Any]:
        """Several commands in one round trip; replies in order, an error reply as an exception in its slot.
        An EVALSHA of a registered script answered NOSCRIPT is run again with EVAL (one more round trip).
        defer: not urgent, may wait a few ms to share a write and a round trip (see _send)."""
        if transaction:
            replies = await self._send([("MULTI",), *cmds, ("EXEC",)])
            exec_reply = replies[-1]
            if isinstance(exec_reply, Exception):
                return [exec_reply] * len(cmds)
            return list(exec_reply)
        replies = await self._send(cmds, defer)
        for i, (cmd, reply) in enumerate(zip(cmds, replies, strict=True)):
            if is_noscript(reply) and cmd[0] == "EVALSHA" and cmd[1] in self._scripts:
                try:
                    replies[i] = await self.execute("EVAL", self._scripts[cmd[1]], *cmd[2:])
                except ReplyError as e:
                    replies[i] = e
        return replies


def _in_task(coro):
    """redis-py's asyncio client needs a current task (its timeouts do); the shim's server runs a handler's first
    step eagerly, outside any task (shim/http.py): there, run `coro` as a task of its own."""
    return coro if asyncio.current_task() is not None else asyncio.ensure_future(coro)


class RedisPyKV:
    """The same interface over a redis.asyncio client (shared between many Shim objects in one process)."""

    def __init__(self, client):
        self.client = client
        self._scripts: dict[str, str] = {}

    async def execute(self, *args: Any) -> Any:
        return await _in_task(self.client.execute_command(*args))

    def register(self, script: Script) -> Script:
        self._scripts[script.sha] = script.text
        return script

    def script(self, script: Script, keys: Sequence[Any], args: Sequence[Any]):
        return _in_task(self._script(script, keys, args))

    async def _script(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        from redis.exceptions import NoScriptError

        try:
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(script.text, len(keys), *keys, *args)

    def pipeline(self, cmds: Iterable[tuple], transaction: bool = False, defer: bool = False):
        return _in_task(self._pipeline(list(cmds), transaction))

    async def _pipeline(self, cmds: list[tuple], transaction: bool) -> list[Any]:
        async with self.client.pipeline(transaction=transaction) as pipe:
            for c in cmds:
                pipe.execute_command(*c)
            replies = await pipe.execute(raise_on_error=False)
        for i, (cmd, reply) in enumerate(zip(cmds, replies, strict=True)):
            if is_noscript(reply) and cmd[0] == "EVALSHA" and cmd[1] in self._scripts:
                try:
                    replies[i] = await self.client.eval(self._scripts[cmd[1]], *cmd[2:])
                except Exception as e:  # noqa: BLE001 - returned in its slot, as pipeline errors are
                    replies[i] = e
        return replies

    def kick(self) -> None:
        """Nothing is deferred here."""

    async def aclose(self) -> None:
        await self.client.aclose()


def as_kv(client) -> KV | RedisPyKV:
    """A KV as is; anything else is taken as a redis-py asyncio client and wrapped."""
    if isinstance(client, (KV, RedisPyKV)):
        return client
    return RedisPyKV(client)
