"""A bare TCP relay (uvloop, no parsing): the floor for any proxy hop on this machine.

    python bench/tcp_relay.py UPSTREAM_HOST UPSTREAM_PORT [BURN_US] [--pin MODEL]   (prints the port it listens on)

bench_shim.py runs it beside the shim, so that the added latency it reports can be read against what one more
process on the path costs here at all (a wake-up of an idle process, two loopback copies).

BURN_US: after passing on each response head, spin that many microseconds of CPU (as the shim spends CPU on a
call's bookkeeping after its answer): what CPU per call alone costs in latency on this machine, with no other
difference on the path.

--pin MODEL: a pinning relay, the least any proxy must do that checks a request and pins its model before
passing it on: each request is read whole (head, Content-Length body), its JSON body parsed (orjson), its
"model" set to MODEL and the body serialised again, then sent on with its new Content-Length; responses pass
through as bytes. What a long prompt costs such a relay is a floor for the shim's long-prompt row."""

from __future__ import annotations

import argparse
import asyncio
import re
import time

import orjson
import uvloop

BURN_S = 0.0
PIN: str | None = None
_CL = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)[ \t]*", re.IGNORECASE)


def _pinned(buf: bytearray) -> tuple[bytes, bytes] | None:
    """The first whole request in `buf` (head, body) with its model pinned (removed from `buf`), or None if not
    all in."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    m = _CL.search(buf, 0, end)
    size = int(m.group(1)) if m else 0
    if len(buf) < end + 4 + size:
        return None
    with memoryview(buf) as view:
        doc = orjson.loads(view[end + 4:end + 4 + size])
    doc["model"] = PIN
    body = orjson.dumps(doc)
    head = bytes(buf[:end + 4])
    if m:
        head = head[:m.start()] + b"\r\nContent-Length: %d" % len(body) + head[m.end():]
    del buf[:end + 4 + size]
    return head, body


def _burn() -> None:
    end = time.perf_counter() + BURN_S
    while time.perf_counter() < end:
        pass


class _Upstream(asyncio.Protocol):
    def __init__(self, down: _Downstream):
        self.down = down

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.down.transport.write(data)
        if BURN_S and data.startswith(b"HTTP/1."):
            _burn()

    def connection_lost(self, exc) -> None:
        self.down.transport.close()


class _Downstream(asyncio.Protocol):
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.up: _Upstream | None = None
        self.early: list[bytes] = []
        self.buf = bytearray()  # --pin: a request not yet whole

    def connection_made(self, transport) -> None:
        self.transport = transport
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.up = await loop.create_connection(lambda: _Upstream(self), self.host, self.port)
        for data in self.early:
            self.up.transport.write(data)
        self.early = []

    def data_received(self, data: bytes) -> None:
        if PIN is not None:
            self.buf += data
            while (request := _pinned(self.buf)) is not None:
                self._send(*request)
        else:
            self._send(data)

    def _send(self, *parts: bytes) -> None:
        if self.up is None:
            self.early += parts
        else:
            self.up.transport.writelines(parts)

    def connection_lost(self, exc) -> None:
        if self.up is not None:
            self.up.transport.close()


async def main(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _Downstream(host, port), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("burn_us", type=float, nargs="?", default=0.0)
    ap.add_argument("--pin", metavar="MODEL")
    args = ap.parse_args()
    BURN_S, PIN = args.burn_us / 1e6, args.pin
    uvloop.run(main(args.host, args.port))
