"""The shim's HTTP/1.1 layer (shim/http.py): framing both ways, keep-alive, bad input, timeouts."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shimtest import self_signed_cert

from shim.http import Server, Upstream, UpstreamConnectError, UpstreamPayloadError


async def _echo_server(max_body: int = 1 << 20, **kw):
    """A Server whose handler answers JSON describing the request (or streams it back, chunked)."""
    seen = []

    async def handler(req, resp):
        seen.append(req)
        doc = {"method": req.method, "path": req.path, "body": req.body.decode(errors="replace"),
               "too_large": req.too_large, "body_error": req.body_error, "h": req.headers.get("X-Test")}
        if req.path.endswith("/stream"):
            resp.begin(200, [("Content-Type", "text/event-stream")])
            for i in range(3):
                resp.put(b"data: %d\n\n" % i)
            resp.finish(b"data: end\n\n")
        elif req.path == "/boom":
            raise RuntimeError("boom")
        else:
            resp.send(200, [("Content-Type", "application/json")], json.dumps(doc).encode())

    server = Server(handler, max_body)
    port = await server.start("127.0.0.1", 0)
    return server, port, seen


async def _raw(port: int, data: bytes, read_until_close: bool = True, expect: int = 1) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    if read_until_close:
        out = await asyncio.wait_for(r.read(), 5)
    else:
        out = b""
        while out.count(b"HTTP/1.1 ") < expect or not out.endswith((b"}", b"\r\n\r\n")):
            out += await asyncio.wait_for(r.read(65536), 5)
    w.close()
    return out


def test_server_framing_keepalive_and_bad_requests():
    async def main():
        server, port, seen = await _echo_server(max_body=100)
        # chunked request body, then a pipelined second request on the same connection
        req = (b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nX-Test: 1\r\n\r\n"
               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
               b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
        out = await _raw(port, req)
        assert out.count(b"HTTP/1.1 200 OK") == 2 and b'"body": "abcde"' in out and b'"body": "hi"' in out
        assert b"Connection: close" in out
        assert seen[0].headers.get("x-test") == "1" and seen[0].headers["X-TEST"] == "1"
        # Expect: 100-continue
        out = await _raw(port, b"POST /c HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
                               b"Connection: close\r\n\r\nok")
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
        # a body over the limit is read and discarded; the handler sees too_large; the connection stays usable
        big = b"x" * 1000
        out = await _raw(port, b"POST /d HTTP/1.1\r\nContent-Length: 1000\r\n\r\n" + big
                         + b"POST /e HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        assert b'"too_large": true' in out and b'"path": "/e"' in out
        # gzip request bodies are decoded; an unknown encoding is reported to the handler
        gz = gzip.compress(b'{"a": 1}')
        out = await _raw(port, b"POST /f HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n"
                               b"Connection: close\r\n\r\n" % len(gz) + gz)
        assert b'"body": "{\\"a\\": 1}"' in out
        out = await _raw(port, b"POST /g HTTP/1.1\r\nContent-Encoding: br\r\nContent-Length: 1\r\n"
                               b"Connection: close\r\n\r\nx")
        assert b"unsupported content-encoding br" in out
        # garbage gets a 400 and the connection is closed; the handler never sees it
        n = len(seen)
        for junk in (b"NONSENSE\r\n\r\n", b"GET / HTTP/9\r\n\r\n", b"POST / HTTP/1.1\r\nBad Header\r\n\r\n",
                     b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
            out = await _raw(port, junk)
            assert out.startswith(b"HTTP/1.1 400"), (junk, out)
        assert len(seen) == n
        # a handler that raises: 500, the server keeps serving
        out = await _raw(port, b"POST /boom HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 500")
        await server.shutdown(1.0)

    asyncio.run(main())


def test_idle_keepalive_connections_are_closed_and_busy_ones_kept(monkeypatch):
    """A connection is closed KEEPALIVE_S after its last answer, not while requests keep coming (its one timer
    is re-armed from the last answer when it fires) and not in the middle of a slow answer."""
    import shim.http as http

    monkeypatch.setattr(http, "KEEPALIVE_S", 0.3)

    async def main():
        gate = asyncio.Event()

        async def handler(req, resp):
            if req.path == "/slow":
                await gate.wait()
            resp.send(200, [("Content-Type", "text/plain")], b"ok")

        server = Server(handler, 1 << 20)
        port = await server.start("127.0.0.1", 0)
        req = b"POST /%b HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"

        async def ask(w, r, path: bytes) -> bytes:
            w.write(req % path)
            return await asyncio.wait_for(r.readuntil(b"\r\n\r\nok"), 5)

        # requests every 0.2 s for 1.2 s: past several keep-alive periods, never idle for one
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(6):
            assert (await ask(w, r, b"a")).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.2)
        assert not r.at_eof()
        # then idle: closed by the server within about one period
        assert await asyncio.wait_for(r.read(), 2) == b""
        # an answer that takes longer than a period: the connection is kept while it is busy
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(req % b"slow")
        await asyncio.sleep(0.8)
        gate.set()
        assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\nok"), 5)).startswith(b"HTTP/1.1 200")
        # a fresh connection that never sends anything is closed too
        r2, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r2.read(), 2) == b""
        assert await asyncio.wait_for(r.read(), 2) == b""
        await server.shutdown(1.0)

    asyncio.run(main())


def test_client_against_server_streams_and_reuses_connections():
    async def main():
        server, port, _ = await _echo_server()
        up = Upstream(f"http://127.0.0.1:{port}/base", connect_timeout=2, read_timeout=2)
        r = await up.post("/x", [("X-Test", "v")], b"payload")
        assert r.status == 200 and r.content_type == "application/json"
        doc = json.loads(await r.read())
        assert doc == {"method": "POST", "path": "/base/x", "body": "payload", "too_large": False, "body_error": None,
                       "h": "v"}
        r.close()
        assert len(up.idle) == 1
        conn = up.idle[0]
        r = await up.post("/stream", [], b"")
        chunks = [c async for c in r.iter_any()]
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: end\n\n"
        r.close()
        assert up.idle == [conn]  # the same connection, reused
        # the server closes idle connections at shutdown: the next request goes on a new connection
        await server.shutdown(0.1)
        server2 = Server(server.handler, 1 << 20)
        await server2.start("127.0.0.1", port)
        r = await up.post("/y", [], b"")
        assert r.status == 200 and json.loads(await r.read())["path"] == "/base/y"
        r.close()
        up.close()
        await server2.shutdown(0.1)

    asyncio.run(main())


def test_client_errors_and_timeouts():
    async def main():
        async def serve(reader, writer, answer: bytes, hold: float = 0):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await asyncio.sleep(hold)
            writer.close()

        async def start(answer: bytes, hold: float = 0):
            srv = await asyncio.start_server(lambda r, w: serve(r, w, answer, hold), "127.0.0.1", 0)
            return srv, srv.sockets[0].getsockname()[1]

        # a body cut short
        srv, port = await start(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        up = Upstream(f"http://127.0.0.1:{port}", 2, 2)
        r = await up.post("/", [], b"")
        with pytest.raises(UpstreamPayloadError):
            await r.read()
        r.close()
        srv.close()
        # a body that ends with the connection; interim 100 Continue skipped
        srv, port = await start(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Unavailable\r\nRetry-After: 2\r\n\r\nbusy")
        r = await Upstream(f"http://127.0.0.1:{port}", 2, 2).post("/", [], b"")
        assert r.status == 503 and r.headers.get("retry-after") == "2" and await r.read() == b"busy"
        r.close()
        srv.close()
        # a read timeout, before the answer and in the middle of the body
        srv, port = await start(b"", hold=2)
        with pytest.raises(TimeoutError):
            await Upstream(f"http://127.0.0.1:{port}", 2, 0.2).post("/", [], b"")
        srv.close()
        srv, port = await start(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n", hold=2)
        r = await Upstream(f"http://127.0.0.1:{port}", 2, 0.2).post("/", [], b"")
        it = r.iter_any()
        assert await it.__anext__() == b"hi"
        with pytest.raises(TimeoutError):
            await it.__anext__()
        r.close()
        srv.close()
        # nobody listening
        with pytest.raises(UpstreamConnectError):
            await Upstream("http://127.0.0.1:1", 1, 1).post("/", [], b"")

    asyncio.run(main())


def test_request_heads_are_parsed_once_per_header_set():
    from shim.http import _request_head

    a = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\nX-Api-Key: k"
    b = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 9999\r\nX-Api-Key: k"
    pa, cla = _request_head(a)
    pb, clb = _request_head(b)
    assert (pa.method, pa.path, cla, clb) == ("POST", "/v1/messages", 12, 9999) and pa is pb  # one parse, shared
    assert "content-length" not in pa.headers and pa.headers["x-api-key"] == "k"
    assert pa.keep_alive and not pa.transfer_encoding and not pa.expect_continue
    assert _request_head(b"POST / HTTP/1.1\r\nHost: y")[0] is not pa
    for bad in (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2",
                b"POST / HTTP/1.1\r\ncontent-length: -1", b"POST / HTTP/1.1\r\nContent-Length: 1e3",
                b"P@ST / HTTP/1.1\r\nHost: x", b"POST / HTTP/1.1 extra\r\nHost: x"):
        with pytest.raises(ValueError):
            _request_head(bad)


def test_head_requests_get_no_body():
    async def main():
        server, port, _ = await _echo_server()
        out = await _raw(port, b"HEAD /x HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"\r\n\r\n")  # Content-Length, no body
        await server.shutdown(0.1)

    asyncio.run(main())


def test_client_over_tls(tmp_path, monkeypatch):
    import ssl

    key, cert = self_signed_cert(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts the system's CAs; here, this one

    async def main():
        async def handler(req, resp):
            resp.send(200, [("Content-Type", "application/json")], b'{"tls": true, "n": %d}' % len(req.body))

        server = Server(handler, 1 << 20)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        loop = asyncio.get_running_loop()
        from shim.http import _ServerConn

        srv = await loop.create_server(lambda: _ServerConn(server), "127.0.0.1", 0, ssl=ctx)
        port = srv.sockets[0].getsockname()[1]
        up = Upstream(f"https://localhost:{port}", 5, 5)
        for _ in range(2):  # the second on the kept-alive TLS connection
            r = await up.post("/v1/messages", [("Content-Type", "application/json")], b"{}")
            assert r.status == 200 and json.loads(await r.read()) == {"tls": True, "n": 2}
            r.close()
        assert len(up.idle) == 1
        up.close()
        srv.close()

    asyncio.run(main())


def test_handlers_start_eagerly_and_go_on_as_tasks():
    """A handler's first step runs in the connection's callback (no task yet); after its first wait it goes on
    as a task; pipelined requests are answered in order, whether their handlers finish at once or wait; a
    handler waiting at shutdown is cancelled (and sees it)."""

    async def main():
        steps, cancelled = [], []
        gate = asyncio.Event()

        async def handler(req, resp):
            steps.append((req.path, "first", asyncio.current_task() is None))
            if req.path.startswith("/wait"):
                await asyncio.sleep(0.01)
                steps.append((req.path, "after", asyncio.current_task() is not None))
            if req.path == "/hang":
                try:
                    await gate.wait()
                except asyncio.CancelledError:
                    cancelled.append(req.path)
                    raise
            resp.send(200, [("Content-Type", "text/plain")], req.path.encode())

        server = Server(handler, 1 << 20)
        port = await server.start("127.0.0.1", 0)
        paths = [f"/{'wait' if i % 3 == 0 else 'now'}{i}" for i in range(30)] + [f"/now{i}" for i in range(30, 3000)]
        data = b"".join(b"POST %s HTTP/1.1\r\nContent-Length: 0\r\n\r\n" % p.encode() for p in paths)
        out = await _raw(port, data + b"POST /last HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
        assert bodies == [p.encode() for p in paths] + [b"/last"]
        # a request that finds its connection idle starts in the connection's callback, outside any task (one
        # parsed after a handler that waited starts in that handler's task, as it ends: no task switch either)
        first = {path: no_task for path, what, no_task in steps if what == "first"}
        assert first["/wait0"] and len(first) == len(paths) + 1
        assert sum(1 for _, what, in_task in steps if what == "after" and in_task) == 10
        # shutdown cancels a handler that is waiting, inside the handler
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /hang HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        await server.shutdown(0.1)
        assert cancelled == ["/hang"]
        w.close()

    asyncio.run(main())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), max_size=30), st.lists(st.integers(1, 400), min_size=1),
       st.booleans())
def test_chunked_bodies_decode_the_same_however_they_are_split(parts, cuts, extensions):
    """_Chunked takes a whole chunk in one step when it is all there, and in states when it is not: the same
    bytes come out for any split of the wire (size lines with extensions, a trailer)."""
    from shim.http import _Chunked

    wire = b"".join(b"%x%s\r\n%b\r\n" % (len(p), b";x=1" if extensions else b"", p) for p in parts)
    wire += b"0\r\nTrailer: t\r\n\r\n"
    decoder, buf, out, done, pos, k = _Chunked(), bytearray(), [], False, 0, 0
    while not done:
        assert pos < len(wire)
        step = cuts[k % len(cuts)]
        buf += wire[pos:pos + step]
        pos, k = pos + step, k + 1
        got, done, used = decoder.feed(buf)
        del buf[:used]
        out += got
    assert b"".join(out) == b"".join(parts) and not buf
