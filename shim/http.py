"""A lean HTTP/1.1 server (for the harness) and client (for the upstream) on asyncio protocols.

Why not aiohttp: on a machine whose CPUs idle between model calls (every task: a call takes seconds), each
step of a call runs with cold caches, and the cost of a proxy hop is the amount of code it executes. aiohttp's
server and client paths (request objects, routers, multidicts, connectors, tracing) cost ~1.5 ms per call that
way; a relay that only frames bytes costs ~0.3 ms (measured in bench/bench_shim.py). So the shim frames HTTP
itself: keep-alive, Content-Length and chunked bodies both ways, Expect: 100-continue, gzip/deflate request
bodies, write back-pressure, read timeouts, TLS upstream.

Server: Server(handler, max_body_bytes). The handler gets (Request, Responder); it answers with
Responder.send(status, headers, body) (one write) or begin() / put() / finish() (chunked; put() says when the
client is not keeping up, on_resume() when it has caught up). One request at a time
per connection (pipelined requests wait). A request line or headers that cannot be parsed get a 400 and the
connection is closed, without reaching the handler (as in any HTTP server). A body over max_body_bytes is read
and discarded, and the handler sees Request.too_large (it answers 413).

Client: Upstream(base_url).post(path, headers, body) -> Response (status, headers, read(), iter_any(),
close()). A connection goes back to the pool once its response was read to the end; a request that fails on a
reused connection before any byte of the answer arrived is sent once more on a new one (the provider closed an
idle keep-alive connection). Errors: UpstreamConnectError, UpstreamPayloadError (both UpstreamError),
TimeoutError.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import ssl as _ssl
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from urllib.parse import urlparse

log = logging.getLogger("shim.http")

MAX_HEAD_BYTES = 64 * 1024
KEEPALIVE_S = 75.0
_REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    408: "Request Timeout", 413: "Payload Too Large", 429: "Too Many Requests", 500: "Internal Server Error",
    502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout", 529: "Overloaded",
}


class Headers(dict):
    """Header values by lower-case name (the last one wins); `raw` keeps the (name, value) pairs as sent.
    `derived`: what a user computed from these headers (request heads are parsed once and shared)."""

    __slots__ = ("derived", "raw")

    def __init__(self, raw: list[tuple[str, str]]):
        super().__init__((k.lower(), v) for k, v in raw)
        self.raw = raw
        self.derived: dict = {}

    def get(self, name: str, default=None):  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name.lower() if isinstance(name, str) else name)

    def items(self):  # type: ignore[override]
        return iter(self.raw)


def _parse_head(head: bytes, strict: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """First line and header pairs of a message head (without the blank line). A malformed header line raises
    ValueError, or is left out if not `strict`."""
    lines = head.decode("latin-1").split("\r\n")
    raw = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            if strict:
                raise ValueError(f"bad header line {line[:60]!r}")
            continue
        raw.append((name, value.strip()))
    return lines[0], raw


# A response's header block as received: its lines, each after a CRLF (what follows the status line, up to the
# blank line). Only its framing headers are read at once; it is split into Headers if someone asks (see
# Response.headers), and a 200's goes to the harness as it came, less the hop-by-hop lines (line_filter).
_FRAMING = re.compile(rb"\r\n(content-length|transfer-encoding|connection):([^\r]*)", re.I)


def line_filter(names: Iterable[str]) -> Callable[[bytes], bytes]:
    """A header block -> the same block without the lines of these (lower-case) header names: one regex pass
    over the bytes, instead of parsing them into pairs and formatting them again."""
    alternatives = b"|".join(re.escape(n.encode("latin-1")) for n in sorted(names, key=len, reverse=True))
    return functools.partial(re.compile(rb"\r\n(?:%b):[^\r]*" % alternatives, re.I).sub, b"")


class _Chunked:
    """Incremental chunked-transfer decoding: feed(buf) -> (data, done, bytes consumed)."""

    __slots__ = ("left", "state")

    def __init__(self) -> None:
        self.state = "size"  # size | data | crlf | trailer | done
        self.left = 0

    def feed(self, buf: bytes | bytearray, start: int = 0) -> tuple[list[bytes], bool, int]:
        out: list[bytes] = []
        i, n = start, len(buf)
        while i < n:
            if self.state == "size":
                j = buf.find(b"\r\n", i)
                if j < 0:
                    if n - i > 1024:
                        raise ValueError("chunk size line too long")
                    break
                line = buf[i:j]
                size = int(line.split(b";", 1)[0] if b";" in line else line, 16)  # ValueError if not a size
                i = j + 2
                if size == 0:
                    self.state = "trailer"
                elif i + size + 2 <= n and buf[i + size:i + size + 2] == b"\r\n":  # the whole chunk is here
                    out.append(bytes(buf[i:i + size]))
                    i += size + 2
                else:
                    self.state, self.left = "data", size
            elif self.state == "data":
                take = min(self.left, n - i)
                out.append(bytes(buf[i:i + take]))
                i += take
                self.left -= take
                if not self.left:
                    self.state = "crlf"
            elif self.state == "crlf":
                if n - i < 2:
                    break
                if buf[i:i + 2] != b"\r\n":
                    raise ValueError("bad chunk end")
                i += 2
                self.state = "size"
            elif self.state == "trailer":  # trailer lines, then an empty line
                j = buf.find(b"\r\n", i)
                if j < 0:
                    break
                empty = j == i
                i = j + 2
                if empty:
                    self.state = "done"
                    return out, True, i
            else:
                return out, True, i
        return out, self.state == "done", i


# =================================================================== server

class _Head:
    """A request head, parsed, with what the server reads from it for every request worked out once."""

    __slots__ = ("encoding", "expect_continue", "headers", "keep_alive", "method", "path", "query",
                 "transfer_encoding", "version")

    def __init__(self, method: str, target: str, version: str, headers: Headers):
        self.method = method
        self.path, _, self.query = target.partition("?")
        self.version = version
        self.headers = headers
        conn = headers.get("connection", "").lower()
        self.keep_alive = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
        self.transfer_encoding = headers.get("transfer-encoding", "").lower()
        self.expect_continue = headers.get("expect", "").lower() == "100-continue"
        self.encoding = headers.get("content-encoding", "").lower().strip()


_HEADS: dict[bytes, _Head] = {}  # request heads without Content-Length -> parsed


def _request_head(head: bytes) -> tuple[_Head, int | None]:
    """(the head parsed, its Content-Length or None) of a request head; ValueError if malformed. A harness
    sends the same head call after call but for its Content-Length: parsed once, then looked up."""
    cl = None
    key = head
    i = head.lower().find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        j = len(head) if j < 0 else j
        text = head[i + 17:j].strip()
        if not text.isdigit():
            raise ValueError("bad content-length")
        cl = int(text)
        key = head[:i] + head[j:]
    hit = _HEADS.get(key)
    if hit is None:
        first, raw = _parse_head(key)
        method, target, version = first.split(" ")
        if version not in ("HTTP/1.1", "HTTP/1.0") or not target.startswith("/") or not method.isalpha():
            raise ValueError(first[:60])
        headers = Headers(raw)
        if "content-length" in headers:
            raise ValueError("more than one content-length")
        if len(_HEADS) >= 256:
            _HEADS.clear()
        hit = _HEADS[key] = _Head(method, target, version, headers)
    return hit, cl



class Request:
    __slots__ = ("body", "body_error", "headers", "keep_alive", "method", "path", "query", "too_large", "version")

    def __init__(self, head: _Head):
        self.method = head.method
        self.path = head.path
        self.query = head.query
        self.version = head.version
        self.headers = head.headers
        self.keep_alive = head.keep_alive
        self.body = b""
        self.too_large = False
        self.body_error: str | None = None


def _head(status: int, headers: Iterable[tuple[str, str]] | Mapping[str, str] | bytes, extra: str,
          close: bool) -> bytes:
    """A response head. `headers`: (name, value) pairs, a mapping, or a header block (see _FRAMING) as bytes."""
    if isinstance(headers, bytes):
        return b"HTTP/1.1 %d %s%b\r\n%s%s\r\n\r\n" % (status, _REASONS.get(status, "Unknown").encode(), headers,
                                                      extra.encode(), b"\r\nConnection: close" if close else b"")
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in (headers.items() if isinstance(headers, Mapping) else headers)]
    lines.append(extra)
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")


class Responder:
    """How a handler answers one request."""

    __slots__ = ("_conn", "_req", "chunked", "done", "started", "status")

    def __init__(self, conn: _ServerConn, req: Request):
        self._conn = conn
        self._req = req
        self.started = False
        self.done = False
        self.chunked = False
        self.status = 0

    def send(self, status: int, headers, body: bytes) -> None:
        """The whole answer in one write. ConnectionError if the client is gone. `headers`: as for _head."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.done = True
        self.status = status
        close = not self._req.keep_alive or self._conn.closing
        head = _head(status, headers, f"Content-Length: {len(body)}", close)
        self._conn.write(head if self._req.method == "HEAD" else head + body)  # HEAD: no body
        self._conn.response_done(close)

    def begin(self, status: int, headers) -> None:
        """A chunked answer: the head now (written at once), data with put(), finish(). ConnectionError if the
        client is gone."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.chunked = True
        self.status = status
        self._conn.write(_head(status, headers, "Transfer-Encoding: chunked", not self._req.keep_alive))

    def put(self, data: bytes) -> bool:
        """Write a chunk now (from a callback); True if the client is not keeping up (see on_resume).
        ConnectionError if the client is gone."""
        if data:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        return self._conn.paused

    def on_resume(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once the client has caught up (after put() returned True)."""
        self._conn.on_resume = callback

    def finish(self, data: bytes = b"") -> None:
        """The last chunk and the end of the answer, in one write."""
        if self.done:
            return
        self.done = True
        self._conn.write((b"%x\r\n%b\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n")
        self._conn.response_done(not self._req.keep_alive)


class _ServerConn(asyncio.Protocol):
    def __init__(self, server: Server):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.req: Request | None = None  # the request whose body is being read
        self.body_left = 0
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.encoding = ""  # of the request whose body is being read
        self.chunked: _Chunked | None = None
        self.busy = False  # a handler is running
        self.closed = False
        self.closing = False
        self.paused = False  # the transport's write buffer is full: the client is not keeping up
        self.on_resume: Callable[[], None] | None = None
        self._idle: asyncio.TimerHandle | None = None  # the keep-alive timer (one per connection, see _arm_idle)
        self._idle_since: float | None = None  # monotonic; None while a request is being read or answered
        self.task: asyncio.Task | None = None

    # ---- transport callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.server.loop is None:  # served by a create_server of the caller's own (tests: TLS)
            self.server.loop = asyncio.get_running_loop()
        self.server.conns.add(self)
        self._arm_idle()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.conns.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        callback, self.on_resume = self.on_resume, None
        if callback is not None:
            callback()  # whoever waits for the client to catch up learns it is gone at its next write

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        callback, self.on_resume = self.on_resume, None
        if callback is not None:
            callback()

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        if self.busy or self.closing or self.buf or self.req is not None or not self._whole(data):
            self.buf += data
            if not self.busy:
                self._parse()

    def _whole(self, data: bytes) -> bool:
        """The usual case, taken without copying into the buffer and out again: one whole request (its head,
        a plain Content-Length body, nothing after it) in one read. False: anything else (nothing done; _parse
        takes it, and answers what is malformed)."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return False
        try:
            parsed, cl = _request_head(data[:end])
        except ValueError:
            return False
        size = len(data) - end - 4
        if ((cl or 0) != size or size > self.server.max_body_bytes or parsed.transfer_encoding
                or parsed.expect_continue or parsed.encoding):
            return False
        req = Request(parsed)
        req.body = data[end + 4:]
        self.busy = True
        self._start(req)  # True (finished, the next request may be parsed) changes nothing: the buffer is empty
        return True

    # ---- writing

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionError("client gone")
        self.transport.write(data)

    def response_done(self, close: bool) -> None:
        if close:
            self.closing = True
            self.transport.close()

    # ---- reading

    def _arm_idle(self) -> None:
        """Idle from now: closed after KEEPALIVE_S without a request. One timer per connection, re-armed when it
        fires (not a timer per request: call_later and cancel on every call cost more than this)."""
        if self.transport is not None and not self.closed:
            self._idle_since = time.monotonic()
            if self._idle is None:
                self._idle = self.server.loop.call_later(KEEPALIVE_S, self._idle_check)

    def _idle_check(self) -> None:
        self._idle = None
        if self.closed or self.transport is None:
            return
        since = self._idle_since
        left = KEEPALIVE_S if since is None else since + KEEPALIVE_S - time.monotonic()
        if left <= 0:
            self.transport.close()
        else:
            self._idle = self.server.loop.call_later(left, self._idle_check)

    def _bad(self, why: str) -> None:
        body = b'{"error":{"type":"invalid_request_error","message":"bad HTTP request"}}'
        try:
            self.write(_head(400, [("Content-Type", "application/json")], f"Content-Length: {len(body)}", True)
                       + body)
        except ConnectionError:
            pass
        self.transport.close()
        self.closing = True
        self.buf.clear()

    def _parse(self) -> None:
        while not self.busy and not self.closing:
            if self.req is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > MAX_HEAD_BYTES:
                        self._bad("head too large")
                    return
                head = bytes(self.buf[:end])
                del self.buf[:end + 4]
                if not head.strip():
                    continue  # stray CRLFs between requests
                try:
                    parsed, cl = _request_head(head)
                    req = Request(parsed)
                    if parsed.transfer_encoding:
                        if parsed.transfer_encoding != "chunked":
                            raise ValueError("unsupported transfer-encoding")
                        self.chunked = _Chunked()
                        self.body_left = -1
                    else:
                        self.body_left = cl or 0
                        self.chunked = None
                except ValueError as e:
                    self._bad(str(e))
                    return
                self.req = req
                self.encoding = parsed.encoding
                self.body_parts, self.body_size = [], 0
                if parsed.expect_continue:
                    try:
                        self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    except ConnectionError:
                        return
            # body
            req = self.req
            if self.chunked is not None:
                try:
                    parts, done, used = self.chunked.feed(self.buf)
                except ValueError as e:
                    self._bad(str(e))
                    return
                del self.buf[:used]
                for p in parts:
                    self._body(p)
                if not done:
                    return
            else:
                take = min(self.body_left, len(self.buf))
                if take:
                    if take == len(self.buf):  # the usual case: one copy, not two (a prompt is 10-200 KB)
                        part = bytes(self.buf)
                        self.buf.clear()
                    else:
                        part = bytes(self.buf[:take])
                        del self.buf[:take]
                    self._body(part)
                    self.body_left -= take
                if self.body_left:
                    return
            self.req = None
            if not req.too_large:
                req.body = b"".join(self.body_parts)
                if self.encoding and self.encoding != "identity":
                    req.body = self._decode(req, self.encoding)
            self.body_parts = []
            self.busy = True
            if not self._start(req):
                return

    def _body(self, part: bytes) -> None:
        req = self.req
        self.body_size += len(part)
        if self.body_size > self.server.max_body_bytes:
            req.too_large = True
            self.body_parts = []
        elif not req.too_large:
            self.body_parts.append(part)

    def _decode(self, req: Request, enc: str) -> bytes:
        try:
            if enc in ("gzip", "x-gzip", "deflate"):
                d = zlib.decompressobj(wbits=47)  # gzip or zlib header
                out = d.decompress(req.body, self.server.max_body_bytes + 1)
                if len(out) > self.server.max_body_bytes:
                    req.too_large = True
                    return b""
                return out
            req.body_error = f"unsupported content-encoding {enc}"
        except zlib.error:
            req.body_error = f"cannot decode {enc} body"
        return b""

    def _start(self, req: Request) -> bool:
        """Run the handler eagerly, in this callback, up to its first wait; then on as a task. The upstream
        write of a call that needs no Valkey round trip comes before that wait, so a task switch (a loop pass
        on cold caches) is no longer between the harness's request and the upstream's. What Python 3.12's eager
        tasks do. True: the handler finished here and the next request may be parsed."""
        coro = self._run(req)
        try:
            waiting_on = coro.send(None)
        except StopIteration as done:
            return done.value
        self.task = self.server.loop.create_task(self._resume(coro, waiting_on))
        return False

    async def _resume(self, coro, waiting_on) -> None:
        if await _Resumed(coro, waiting_on) and self.buf:
            self._parse()

    async def _run(self, req: Request) -> bool:
        """The handler, then the connection's next step; True if the next request may be parsed now."""
        resp = Responder(self, req)
        self.server.active.add(self)
        try:
            await self.server.handler(req, resp)
        except asyncio.CancelledError:
            if not self.closed and self.transport is not None:
                self.transport.close()
            raise
        except Exception:
            log.exception("unhandled error in request handler")
            if not resp.started and not self.closed:
                try:
                    resp.send(500, [("Content-Type", "application/json")],
                              b'{"error":{"type":"api_error","message":"shim internal error"}}')
                except ConnectionError:
                    pass
            elif not resp.done and self.transport is not None:
                self.transport.close()
        finally:
            self.server.active.discard(self)
            self.task = None
            self.busy = False
        if not resp.done and not self.closed and self.transport is not None:
            self.transport.close()  # a handler that never finished its answer: the connection is unusable
            return False
        if self.closing or self.closed:
            return False
        if self.server.stopping:
            self.transport.close()
            return False
        if self.buf:
            return True
        self._arm_idle()
        return False


class _Resumed:
    """Awaiting it goes on with a coroutine started by hand (its first send() returned `waiting_on`, what it
    waits for): the task waits on that as the coroutine's own task would have, then drives the coroutine to
    its end, passing each value or exception (a cancel) on. Returns what the coroutine returns."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro, waiting_on) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def __await__(self):
        coro, step = self.coro, self.waiting_on
        while True:
            try:
                value = yield step
            except BaseException as e:  # noqa: BLE001 - passed on into the coroutine
                resume, arg = coro.throw, e
            else:
                resume, arg = coro.send, value
            try:
                step = resume(arg)
            except StopIteration as done:
                return done.value


Handler = Callable[[Request, Responder], Awaitable[None]]


class Server:
    def __init__(self, handler: Handler, max_body_bytes: int):
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.conns: set[_ServerConn] = set()
        self.active: set[_ServerConn] = set()
        self.stopping = False
        self._server: asyncio.base_events.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # kept: get_running_loop() is a getpid(2) on 3.11

    async def start(self, host: str, port: int) -> int:
        self.loop = loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConn(self), host, port, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting; close idle connections; give running handlers timeout_s, then cancel them."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            if not c.busy and c.transport is not None:
                c.transport.close()
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        tasks = [c.task for c in list(self.active) if c.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()


# =================================================================== client


class UpstreamError(Exception):
    pass


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamPayloadError(UpstreamError):
    pass


class _ClientConn(asyncio.Protocol):
    """One upstream connection; parses one response at a time into status, headers and body data."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.closed = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by Upstream._connect
        self.reset()

    def reset(self) -> None:
        self.sink: Callable[[bytes], None] | None = None  # body data goes here as it arrives (Response.relay)
        self.on_end: Callable[[], None] | None = None
        self.on_complete: Callable[[_ClientConn], None] | None = None  # see Upstream.post_head
        self.on_head: Callable[[_ClientConn], None] | None = None  # likewise
        self.status = 0
        self.block: bytes | None = None  # the header block (see _FRAMING), once the head is in
        self.body: deque[bytes] = deque()
        self.queued = 0
        self.body_left = 0  # -1: until close
        self.chunked: _Chunked | None = None
        self.complete = False
        self.got_bytes = False
        self.keep_alive = True
        self.reading_paused = False
        self.no_body = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.block is not None and self.body_left == -1 and not self.complete:
            self.complete = True  # a body delimited by the connection's end
        elif not self.complete:
            self.error = UpstreamPayloadError("upstream closed the connection") if self.block is not None \
                else UpstreamConnectError("upstream closed the connection")
        self._deliver()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.buf += data
        try:
            self._parse()
        except ValueError as e:
            self.error = UpstreamPayloadError(f"bad upstream response: {e}")
            self.transport.close()
        if self.sink is not None:
            self._deliver()
        elif self.on_complete is not None and self.complete and self.error is None:
            on_complete, self.on_complete = self.on_complete, None
            on_complete(self)
        elif self.on_head is not None and self.block is not None:
            on_head, self.on_head = self.on_head, None
            on_head(self)
        self._wake()

    def _deliver(self) -> None:
        """With a sink: hand it what arrived (in one piece), then tell it once the body ended or failed."""
        if self.sink is None:
            return
        if self.body:
            self.sink(self.take())
        if (self.complete or self.error is not None or self.closed) and self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()

    def _parse(self) -> None:
        if self.block is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    raise ValueError("head too large")
                return
            head = bytes(self.buf[:end])
            del self.buf[:end + 4]
            i = head.find(b"\r\n")
            first, block = (head, b"") if i < 0 else (head[:i], head[i:])
            version, _, rest = first.partition(b" ")
            status = int(rest[:3])
            if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
                self._parse()
                return
            self.status = status
            self.block = block
            # the framing headers only (the last of a name wins, as in Headers); the rest stays a block
            framing = {name.lower(): value.strip() for name, value in _FRAMING.findall(block)}
            conn = framing.get(b"connection", b"").lower()
            self.keep_alive = b"close" not in conn if version == b"HTTP/1.1" else b"keep-alive" in conn
            if self.no_body or status in (204, 304):
                self.body_left = 0
            elif b"chunked" in framing.get(b"transfer-encoding", b"").lower():
                self.chunked = _Chunked()
            elif b"content-length" in framing:
                self.body_left = int(framing[b"content-length"])
            else:
                self.body_left = -1
                self.keep_alive = False
            if self.chunked is None and self.body_left == 0:
                self.complete = True
        if self.block is None or self.complete:
            return
        if self.chunked is not None:
            parts, done, used = self.chunked.feed(self.buf)
            del self.buf[:used]
            for p in parts:
                self._queue(p)
            if done:
                self.complete = True
        elif self.buf:
            if self.body_left == -1:
                self._queue(bytes(self.buf))
                self.buf.clear()
            else:
                take = min(self.body_left, len(self.buf))
                self._queue(bytes(self.buf[:take]))
                del self.buf[:take]
                self.body_left -= take
                if not self.body_left:
                    self.complete = True

    def _queue(self, data: bytes) -> None:
        if data:
            self.body.append(data)
            self.queued += len(data)
            if self.queued > (1 << 20) and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()

    async def wait(self, timeout: float) -> None:
        """Until more of the response arrived (or the connection ended); TimeoutError after `timeout` s."""
        loop = self.loop
        self.waiter = fut = loop.create_future()
        timer = loop.call_later(timeout, self._timed_out, fut) if timeout else None
        try:
            await fut
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _timed_out(fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_exception(TimeoutError("upstream read timed out"))

    def whole_body(self) -> bytes:
        """The body of a complete response, left in place for Response.read()."""
        body = self.body
        if len(body) > 1:
            data = b"".join(body)
            body.clear()
            body.append(data)
        return body[0] if body else b""

    def take(self) -> bytes:
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join([body.popleft() for _ in range(len(body))])
        self.queued -= len(data)
        if self.reading_paused and self.queued < (1 << 19):
            self.reading_paused = False
            self.transport.resume_reading()
        return data


class _Body:
    __slots__ = ("conn", "timeout")

    def __init__(self, conn: _ClientConn, timeout: float):
        self.conn = conn
        self.timeout = timeout

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        """What has arrived since the last call, in one piece (events that came together go on together)."""
        c = self.conn
        while True:
            if c.body:
                return c.take()
            if c.complete:
                raise StopAsyncIteration
            if c.error is not None:
                raise c.error
            if c.closed:
                raise UpstreamPayloadError("upstream closed the connection")
            await c.wait(self.timeout)


class Response:
    __slots__ = ("_conn", "_headers", "_pool", "block", "status")

    def __init__(self, conn: _ClientConn, pool: Upstream):
        self._conn = conn
        self._pool = pool
        self.status = conn.status
        self.block: bytes = conn.block  # the header block as received (see _FRAMING)
        self._headers: Headers | None = None

    @property
    def headers(self) -> Headers:
        """Parsed on first use (a line that is not a header is left out). A 200 does not need them: it goes to
        the harness as its block, filtered (line_filter)."""
        if self._headers is None:
            self._headers = Headers(_parse_head(self.block, strict=False)[1])
        return self._headers

    @property
    def content_type(self) -> str:
        return (self.headers.get("content-type") or "application/octet-stream").split(";", 1)[0].strip()

    def relay(self, sink: Callable[[bytes], None], on_end: Callable[[], None]) -> None:
        """Have the body handed to `sink` as it arrives, from the connection's callback (no task switch per
        piece), and `on_end()` called once when it has ended or failed (Response.error says which). What
        arrived before is handed over now. detach() stops it."""
        c = self._conn
        c.sink, c.on_end = sink, on_end
        c._deliver()

    def detach(self) -> None:
        c = self._conn
        if c is not None:
            c.sink = c.on_end = None

    @property
    def error(self) -> Exception | None:
        """Why the body broke off (None: it ended, or has not yet)."""
        c = self._conn
        if c is None or c.error is not None:
            return None if c is None else c.error
        if c.closed and not c.complete:
            return UpstreamPayloadError("upstream closed the connection")
        return None

    def pause_reading(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._conn is not None and self._conn.transport is not None and not self._conn.closed:
            self._conn.transport.resume_reading()

    def iter_any(self) -> _Body:
        """The body as it arrives (chunked framing removed): an async iterator of bytes."""
        return _Body(self._conn, self._pool.read_timeout)

    async def read(self) -> bytes:
        c = self._conn
        if c.complete and c.error is None:  # the usual case: the whole body came with the head
            data = b"".join(c.body)
            c.body.clear()
            c.queued = 0
            return data
        return b"".join([chunk async for chunk in self.iter_any()])

    def close(self) -> None:
        c, self._conn = self._conn, None
        if c is None:
            return
        if c.complete and c.keep_alive and not c.closed and not c.buf and c.error is None:
            c.reset()
            self._pool.idle.append(c)
        elif c.transport is not None:
            c.transport.close()


class Upstream:
    """A keep-alive pool of connections to one base URL."""

    def __init__(self, base_url: str, connect_timeout: float, read_timeout: float):
        u = urlparse(base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"unsupported upstream URL {base_url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = _ssl.create_default_context() if u.scheme == "https" else None
        self.base_path = u.path.rstrip("/")
        default = (u.scheme == "https" and self.port == 443) or (u.scheme == "http" and self.port == 80)
        self.host_header = self.host if default else f"{self.host}:{self.port}"
        if ":" in self.host and not self.host.startswith("["):
            self.host_header = f"[{self.host}]" + ("" if default else f":{self.port}")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle: list[_ClientConn] = []

    async def _connect(self) -> _ClientConn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_ClientConn, self.host, self.port, ssl=self.ssl,
                                       server_hostname=self.host if self.ssl else None),
                self.connect_timeout)
        except TimeoutError as e:
            raise UpstreamConnectError("upstream connect timed out") from e
        except OSError as e:
            raise UpstreamConnectError(f"cannot connect upstream: {e}") from e
        conn.loop = loop
        return conn

    def _get_idle(self) -> _ClientConn | None:
        while self.idle:
            c = self.idle.pop()
            if not c.closed and not c.transport.is_closing() and not c.buf:
                return c
            if c.transport is not None:
                c.transport.close()
        return None

    def head(self, path: str, headers: Iterable[tuple[str, str]]) -> bytes:
        """A POST request's head up to (not including) its Content-Length line."""
        lines = [f"POST {self.base_path}{path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers]
        return ("\r\n".join(lines) + "\r\n").encode("latin-1", "replace")

    async def post(self, path: str, headers: Iterable[tuple[str, str]], body: bytes) -> Response:
        return await self.post_head(self.head(path, headers), body)

    async def post_head(self, head: bytes, body: bytes, on_complete: Callable[[_ClientConn], None] | None = None,
                        on_head: Callable[[_ClientConn], None] | None = None) -> Response:
        """POST with a head from head(): Content-Length and the body are added here. `on_complete(conn)`: called
        from the connection's callback as soon as the whole response is in (status, block, whole_body()),
        before this returns; what it does not consume, read() still returns. `on_head(conn)`: likewise as soon
        as the head is in (status, block), for a response that is not complete by then."""
        head = b"%bContent-Length: %d\r\n\r\n" % (head, len(body))  # and the body beside it (one writev, no copy)
        for fresh in (False, True):
            conn = None if fresh else self._get_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            conn.on_complete = on_complete
            conn.on_head = on_head
            conn.transport.writelines((head, body))
            try:
                while conn.block is None:
                    if conn.error is not None:
                        raise conn.error
                    if conn.closed:
                        raise UpstreamConnectError("upstream closed the connection")
                    await conn.wait(self.read_timeout)
            except UpstreamError:
                if conn.transport is not None:
                    conn.transport.close()
                if reused and not conn.got_bytes:
                    continue  # a stale keep-alive connection: once more on a new one
                raise
            except BaseException:
                if conn.transport is not None:
                    conn.transport.close()
                raise
            return Response(conn, self)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for c in self.idle:
            if c.transport is not None:
                c.transport.close()
        self.idle.clear()
