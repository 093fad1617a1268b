"""The project's one TCP relay: `listen_host:listen_port -> target_host:target_port`, one line per route.

Standard library only and self-contained, because it runs in three places: inside the egress container (as
`python3 -c` with this file's source, so no image has to ship it), as a host relay thread in the dispatcher
(Relay), and in the agent's sandbox, joining a listener in the agent's network namespace to the shim's port on the
host's (serve_listener, in a process of its own).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading

Route = tuple[str, int, str, int]  # listen host, listen port, target host, target port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction; at its end of file, the other side's writing half is shut (a half-close passes through)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()  # a reset on one side resets the other


def _handler(target_host: str, target_port: int):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(target_host, target_port), 10)
        except (TimeoutError, OSError):
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    return handle


async def serve(routes: list[Route], ready: threading.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    servers = [await asyncio.start_server(_handler(th, tp), lh, lp, reuse_address=True) for lh, lp, th, tp in routes]
    if ready is not None:
        ready.set()
    try:
        await (stop.wait() if stop else asyncio.Event().wait())
    finally:
        for s in servers:
            s.close()


async def serve_listener(listener: socket.socket, target_host: str, target_port: int) -> None:
    """Relay each connection to an already bound and listening socket (one made in another network namespace)
    to target_host:target_port, forever."""
    server = await asyncio.start_server(_handler(target_host, target_port), sock=listener)
    async with server:
        await server.serve_forever()


def parse(spec: str) -> Route:
    """`0.0.0.0:10001=172.17.0.1:6379` -> ("0.0.0.0", 10001, "172.17.0.1", 6379)."""
    listen, target = spec.split("=")
    lh, lp = listen.rsplit(":", 1)
    th, tp = target.rsplit(":", 1)
    return lh, int(lp), th, int(tp)


class Relay:
    """Forwarder routes served from a daemon thread (the host side of the egress)."""

    def __init__(self, routes: list[Route]):
        self.routes = routes
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="egress-relay")
        self._thread.start()
        self._ready.wait(10)
        if self._error:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        try:
            self._loop.run_until_complete(serve(self.routes, self._ready, self._stop))
        except BaseException as e:  # noqa: BLE001 - bind failures surface in __init__
            self._error = e
            self._ready.set()

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5)


if __name__ == "__main__":
    asyncio.run(serve([parse(a) for a in sys.argv[1:]]))
