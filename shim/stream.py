"""Relaying one upstream SSE stream to the harness, from the upstream connection's callback.

Why from the callback: on an idle task every step of a call runs with cold caches, and a task switch per piece
of a stream (wake a future, resume a coroutine through an async iterator) was about a third of the shim's time
between a chunk arriving and it going out. Here each piece is split into events, metered and written in the
callback that received it; the handler task only waits for the outcome.

The harness gets the answer's head (200, text/event-stream) as soon as the first upstream attempt's head is in:
its time to first byte is the provider's. The events are held back until the first content event, so that a
failure before it can be retried without the harness seeing any of them: a retried attempt's events follow
the same head (and if every attempt fails, the error ends that stream as an error event; shim/server.py).

Phases: `hold` (events held back until the first content event), `relay` (committed: pieces go out as they
arrive), `drain` (the final or error event went out with the end of the answer; the rest is read for the meter
only). The handler reads `outcome` once `finished` is done:
  retry_early  the stream broke or ended before any content (`failure` says how)
  retry_error  an error event came before any content and it is worth retrying (e.g. overloaded)
  cut          committed, then the client went away or the upstream broke or ended early (`failure`)
  ended        committed, and the upstream body ended
"""

from __future__ import annotations

import asyncio
import time

from shim.http import Responder, Response
from shim.wire import SSESplitter, StreamMeter, retryable_stream_error

CLIENT_GONE = "client disconnected"


class StreamRelay:
    def __init__(self, kind: str, upstream: Response, out: Responder, max_buffer: int,
                 loop: asyncio.AbstractEventLoop | None = None):
        """`out` has begun: the harness has the head (sent from the upstream connection's callback, as soon as
        the first attempt's head was in: shim/server.py Call.begin_now)."""
        self.meter = StreamMeter(kind)
        self.split = SSESplitter()
        self.upstream = upstream
        self.out = out
        self.max_buffer = max_buffer
        self.phase = "hold"
        self.held: list[bytes] = []
        self.held_bytes = 0
        self.outcome: str | None = None
        self.failure: str | None = None
        self.answer_ended = False  # the terminating chunk went out (with the final or error event)
        self.loop = loop or asyncio.get_running_loop()
        self.finished = self.loop.create_future()
        self.last_data = time.monotonic()
        self.held_back = False  # upstream reading is paused until the harness catches up
        self._timer: asyncio.TimerHandle | None = None  # the read timeout (wait)

    def start(self) -> None:
        self.upstream.relay(self.feed, self.on_end)

    # ------------------------------------------------------------ callbacks

    def feed(self, data: bytes) -> None:
        self.last_data = time.monotonic()
        meter = self.meter
        for event, payload in self.split.feed(data):
            meter.on_event(event, payload)
        phase = self.phase
        if phase == "relay":
            if meter.done or meter.error is not None:
                self._end_answer(data)
            else:
                self._put(data)
        elif phase == "hold":
            self.held.append(data)
            self.held_bytes += len(data)
            if meter.error_before_content and retryable_stream_error(meter.error or {}):
                self._finish("retry_error")
            elif meter.error_before_content or meter.meaningful or meter.done or self.held_bytes > self.max_buffer:
                self._commit()

    def on_end(self) -> None:
        err = self.upstream.error
        if self.phase == "hold":
            if err is not None:
                self.failure = f"upstream stream failed: {type(err).__name__}"
            else:
                self.failure = "upstream stream ended before any content"
            self._finish("retry_early")
        elif self.phase == "relay":
            self.failure = (f"upstream stream failed: {type(err).__name__}" if err is not None
                            else "upstream stream ended early")
            self._finish("cut")
        elif self.phase == "drain":
            self._finish("ended")

    def _resume(self) -> None:
        """The harness caught up (or went away: the next write says which)."""
        self.held_back = False
        self.last_data = time.monotonic()
        if self.outcome is None:
            self.upstream.resume_reading()

    # ------------------------------------------------------------ steps

    def _commit(self) -> None:
        """From here on the harness has events and the call cannot be retried."""
        data = b"".join(self.held)
        self.held = []
        if self.meter.done or self.meter.error is not None:
            self._end_answer(data)
        else:
            self.phase = "relay"
            self._put(data)

    def _put(self, data: bytes) -> None:
        try:
            if self.out.put(data):  # the harness is not keeping up: stop reading until it has
                self.held_back = True
                self.upstream.pause_reading()
                self.out.on_resume(self._resume)
        except (ConnectionError, RuntimeError):
            self.failure = CLIENT_GONE
            self._finish("cut")

    def _end_answer(self, data: bytes) -> None:
        """The stream is over: end the answer now; what follows is read for the meter only (and to keep the
        connection reusable); nothing after the final or error event is relayed."""
        self.phase = "drain"
        self.answer_ended = True
        try:
            self.out.finish(data)
        except (ConnectionError, RuntimeError):
            pass  # the harness had everything but the end; the call is complete upstream

    def _finish(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.upstream.detach()
            self.out.on_resume(None)
            if not self.finished.done():
                self.finished.set_result(outcome)

    # ------------------------------------------------------------ the handler's side

    async def wait(self, read_timeout: float) -> str:
        """Until the outcome; TimeoutError if the upstream sent nothing for `read_timeout` seconds (one timer,
        re-armed from the last piece's time when it fires)."""
        if read_timeout:
            self._timer = self.loop.call_later(read_timeout, self._check_idle, read_timeout)
        try:
            return await self.finished
        finally:
            if self._timer is not None:
                self._timer.cancel()

    def _check_idle(self, read_timeout: float) -> None:
        if self.finished.done():
            return
        now = time.monotonic()
        if self.held_back:  # waiting for the harness, not for the upstream
            self.last_data = now
        idle = now - self.last_data
        if idle >= read_timeout:
            self.upstream.detach()
            self.finished.set_exception(TimeoutError("upstream read timed out"))
        else:
            self._timer = self.loop.call_later(read_timeout - idle, self._check_idle, read_timeout)

    def stop(self) -> None:
        """The handler gives up (cancelled, or timed out): no more callbacks."""
        self.upstream.detach()
        self.out.on_resume(None)
