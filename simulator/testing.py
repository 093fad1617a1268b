"""Run the simulator for tests and benchmarks: in a background thread, or as a real subprocess."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aiohttp import web

from plumbing.services import Service
from simulator.app import make_app
from simulator.config import SimulatorConfig


@contextmanager
def running_app(app: web.Application, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve an aiohttp app from a background thread with its own event loop; yields the base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, host, 0).start()
        return runner.addresses[0][1]

    thread = threading.Thread(target=loop.run_forever, name="app-server", daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@contextmanager
def running_simulator(config: SimulatorConfig | None = None, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve the simulator from a background thread with its own event loop; yields the base URL."""
    with running_app(make_app(config or SimulatorConfig()), host) as url:
        yield url


@contextmanager
def simulator_process(
    config: SimulatorConfig | None = None, host: str = "127.0.0.1", timeout_s: float = 20.0
) -> Iterator[str]:
    """Run `python -m simulator` as a subprocess on a free port; yields the base URL."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        argv = [sys.executable, "-m", "simulator", "--host", host, "--port", "0", "--port-file", str(port_file),
                *(config or SimulatorConfig()).to_argv()]
        with Service(argv, name="the simulator", log=Path(tmp) / "simulator.log", ready_file=port_file,
                     timeout_s=timeout_s) as sim:
            yield f"http://{host}:{sim.port}"
