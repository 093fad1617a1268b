"""A bare TCP relay (uvloop, no parsing): the floor for any proxy hop on this machine.

    python bench/tcp_relay.py UPSTREAM_HOST UPSTREAM_PORT [BURN_US]   (prints the port it listens on)

bench_shim.py runs it beside the shim, so that the added latency it reports can be read against what one more
process on the path costs here at all (a wake-up of an idle process, two loopback copies).

BURN_US: after passing on each response head, spin that many microseconds of CPU (as the shim spends CPU on a
call's bookkeeping after its answer): what CPU per call alone costs in latency on this machine, with no other
difference on the path."""

from __future__ import annotations

import asyncio
import sys
import time

import uvloop

BURN_S = 0.0


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
        if self.up is None:
            self.early.append(data)
        else:
            self.up.transport.write(data)

    def connection_lost(self, exc) -> None:
        if self.up is not None:
            self.up.transport.close()


async def main(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _Downstream(host, port), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) > 3:
        BURN_S = float(sys.argv[3]) / 1e6
    uvloop.run(main(sys.argv[1], int(sys.argv[2])))
