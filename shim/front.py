"""The compiled data plane (shim/dataplane) as this process's child, and this process as its control plane.

Why: on a call's path the Python shim adds 0.4-0.6 ms (0.9 ms with a 150 KB prompt) on the VMs we measured; the
same path compiled adds 0.1-0.25 ms (docs/shim.md, "The data plane"). So with `dataplane: compiled` the harness
talks to the compiled process, and this one keeps everything off the path: tickets (the hold and pool booking
of a call, taken ahead, or on the child's ask: shim/gate.py), metering, the ledger, settles, progress, limit
discovery, and every call the compiled side does not take (refused a ticket, bad requests, retries: they reach
shim/server.py over loopback).

Protocol: lines of JSON on a Unix socket pair (the child's end named by `--control-fd`). This side writes the
config first (with the real key: never argv or the environment), then `ticket` (lend one, or the answer to an
ask: `for`), `no` (an ask refused), `recall`, `discover` (send the next answer's rate-limit headers), `sync` and
`stop`. The child writes `ready`, `ask` (a call no lent ticket covers: Shim._ask), `end` (a call's answer went to
the harness: usage, timings; or it was cut at shutdown), `recalled`, `synced` (its calls in flight, after every
`end` it held back: DataPlane.sync) and `bye`. A call whose attempt failed in a way
worth retrying comes to shim/server.py as an HTTP request with `x-evalplane-resume` (Shim.resume).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("shim.front")

BIN_ENV = "SHIM_DATAPLANE_BIN"
_ROOT = Path(__file__).resolve().parents[1]


def binary() -> Path | None:
    """Where the compiled data plane is: $SHIM_DATAPLANE_BIN, else what scripts/build_dataplane.sh built."""
    env = os.environ.get(BIN_ENV)
    if env:
        return Path(env)
    state = Path(os.environ.get("EVALPLANE_STATE_DIR", _ROOT / ".state"))
    for p in (state / "shim_dataplane", Path("/usr/local/bin/shim_dataplane")):
        if p.exists():
            return p
    return None


class DataPlaneError(RuntimeError):
    pass


class _Lines(asyncio.Protocol):
    def __init__(self, on_line: Callable[[dict[str, Any]], None], on_lost: Callable[[], None]):
        self.buf = b""
        self.on_line = on_line
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        *lines, self.buf = buf.split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line.decode())  # (str: json's detect_encoding for bytes costs as much again)
            except ValueError:
                log.error("data plane: unreadable line %r", line[:200])
                continue
            try:
                self.on_line(msg)
            except Exception:  # noqa: BLE001 - one bad message must not end the control channel
                log.exception("data plane: handling %s failed", msg.get("t"))

    def connection_lost(self, exc) -> None:
        self.on_lost()


class DataPlane:
    """The child process and its control socket. `on_message(msg)` gets every line the child writes."""

    def __init__(self, on_message: Callable[[dict[str, Any]], None]):
        self.on_message = on_message
        self.secret = secrets.token_hex(16)  # proves a resume or a returned ticket came from the child
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.alive = False
        self._transport: asyncio.Transport | None = None
        self._ready: asyncio.Future | None = None
        self._bye: asyncio.Future | None = None
        self._out: list[bytes] = []  # lines to write at the end of this turn of the event loop (send)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._syncs: dict[int, asyncio.Future] = {}
        self._next_sync = 0

    @staticmethod
    def usable(upstream_url: str) -> str | None:
        """Why the compiled data plane cannot serve this shim, or None."""
        if urlparse(upstream_url).scheme != "http":
            return "an https upstream (the compiled data plane speaks plain HTTP)"
        if binary() is None:
            return "no shim_dataplane binary (scripts/build_dataplane.sh builds it)"
        return None

    async def start(self, cfg, python_port: int, upstream_key: str | None, default_max_out: int) -> int:
        loop = self._loop = asyncio.get_running_loop()
        u = urlparse(cfg.upstream_url.rstrip("/").removesuffix("/v1"))
        port = u.port or 80
        host = u.hostname or "127.0.0.1"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fd = theirs.fileno()
            self.proc = subprocess.Popen(
                [str(binary()), "--control-fd", str(fd)], stdin=subprocess.DEVNULL, pass_fds=(fd,),
                env={"PATH": os.environ.get("PATH", "")},  # nothing of ours: the key comes on the socket
            )
        finally:
            theirs.close()
        self._ready = loop.create_future()
        self._bye = loop.create_future()
        self._transport, _ = await loop.create_unix_connection(
            lambda: _Lines(self._on_line, self._on_lost), sock=ours)
        self.alive = True
        self.send({
            "python": f"127.0.0.1:{python_port}", "listen_host": cfg.listen_host, "listen_port": cfg.listen_port,
            "upstream": f"{host}:{port}", "host_header": u.netloc, "base_path": u.path.rstrip("/"),
            "model": cfg.model, "token": cfg.local_token, "key": upstream_key or "", "secret": self.secret,
            "max_body_bytes": cfg.max_body_bytes, "read_timeout_s": cfg.sock_read_timeout_s,
            "connect_timeout_s": cfg.connect_timeout_s, "max_stream_buffer_bytes": cfg.max_stream_buffer_bytes,
            "default_max_out": default_max_out, "shutdown_timeout_s": cfg.shutdown_timeout_s,
            # its `end` lines wait, and go together (after the call's answer, as _finish_soon): a lone call's
            # finish_delay_s, at most 5 ms (the wait for its bookkeeping is this process's, which a call that starts
            # meanwhile cuts short, and the data plane's calls on lent tickets start without telling it); while
            # calls overlap, end_batch_s
            "batch_s": min(cfg.finish_delay_s, 0.005), "batch_long_s": cfg.end_batch_s,
        })
        try:
            self.port = await asyncio.wait_for(asyncio.shield(self._ready), 10)
        except TimeoutError:
            self.kill()
            raise DataPlaneError("the compiled data plane did not start") from None
        return self.port

    def send(self, msg: dict[str, Any]) -> None:
        """One line to the child, written with the others sent in this turn of the event loop (one system call,
        not one per line: a call's bookkeeping lends tickets while another's asks are answered)."""
        if self._transport is None or self._transport.is_closing():
            return
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(json.dumps(msg, separators=(",", ":")).encode())

    def _flush(self) -> None:
        lines, self._out = self._out, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"\n".join(lines) + b"\n")

    async def sync(self, timeout_s: float = 2.0) -> int | None:
        """The child's calls in flight, once every `end` line it held back (its Outbox batches them) has been
        handled here: with this process's own in_flight, no call that reached the harness is missing from the
        ledger. None if the child did not answer."""
        if not self.alive:
            return None
        self._next_sync += 1
        sid = self._next_sync
        fut = self._syncs[sid] = self._loop.create_future()
        self.send({"t": "sync", "id": sid})
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except (TimeoutError, DataPlaneError):
            return None
        finally:
            self._syncs.pop(sid, None)

    def _on_line(self, msg: dict[str, Any]) -> None:
        t = msg.get("t")
        if t == "synced":
            fut = self._syncs.get(msg.get("id"))
            if fut is not None and not fut.done():
                fut.set_result(int(msg["in_flight"]))
            return
        if t == "ready":
            if not self._ready.done():
                self._ready.set_result(int(msg["port"]))
            return
        if t == "bye":
            if not self._bye.done():
                self._bye.set_result(msg)
            return
        self.on_message(msg)

    def _on_lost(self) -> None:
        self.alive = False
        for fut in (self._ready, self._bye, *self._syncs.values()):
            if fut is not None and not fut.done():
                fut.set_exception(DataPlaneError("the compiled data plane went away"))
        self.on_message({"t": "lost"})

    async def stop(self, timeout_s: float) -> None:
        """Stop taking connections; the calls in flight finish (up to `timeout_s`), then the child exits."""
        if self.proc is None:
            return
        self.send({"t": "stop"})
        try:
            await asyncio.wait_for(asyncio.shield(self._bye), timeout_s + 2)
        except (TimeoutError, DataPlaneError):
            pass
        if self._transport is not None:
            self._transport.close()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 2)
        except TimeoutError:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
