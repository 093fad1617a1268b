"""The dashboard's web app (aiohttp): one page, its JSON, and server-sent events that push a run's view.

  GET /                  the page (static; it follows a run over /events/<run> and the run list over /events)
  GET /api/runs          runs with a live view, newest first
  GET /api/runs/<run>    one run's view (404 if it has none)
  GET /events[/<run>]    server-sent events: the same JSON, sent when it changes (a comment every 15 s keeps the
                         connection open through proxies)
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from importlib import resources
from pathlib import Path

import redis.asyncio as aioredis
from aiohttp import web

from dispatcher.dashboard.view import LiveSource, ValkeyLiveSource

log = logging.getLogger("evalplane.dashboard")

SOURCE = web.AppKey("source", LiveSource)
INTERVAL = web.AppKey("interval_s", float)
KEEPALIVE_S = 15.0
DEFAULT_PORT = 8270


def make_app(source: LiveSource, interval_s: float = 1.0) -> web.Application:
    app = web.Application()
    app[SOURCE], app[INTERVAL] = source, interval_s
    app.router.add_get("/", _index)
    app.router.add_get("/api/runs", _runs)
    app.router.add_get("/api/runs/{run}", _run)
    app.router.add_get("/events", _events)
    app.router.add_get("/events/{run}", _events)
    return app


async def _index(request: web.Request) -> web.Response:
    page = resources.files("dispatcher.dashboard").joinpath("static/index.html").read_text()
    return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-store"})


async def _payload(source: LiveSource, run: str | None) -> str | None:
    if run is None:
        return json.dumps([r.model_dump() for r in await source.runs()])
    view = await source.run(run)
    return None if view is None else view.model_dump_json()


async def _runs(request: web.Request) -> web.Response:
    return web.Response(text=await _payload(request.app[SOURCE], None), content_type="application/json")


async def _run(request: web.Request) -> web.Response:
    body = await _payload(request.app[SOURCE], request.match_info["run"])
    if body is None:
        raise web.HTTPNotFound(text=json.dumps({"error": f"no live view of run {request.match_info['run']!r}"}),
                               content_type="application/json")
    return web.Response(text=body, content_type="application/json")


async def _events(request: web.Request) -> web.StreamResponse:
    source, every = request.app[SOURCE], request.app[INTERVAL]
    run = request.match_info.get("run")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    last, quiet = None, 0.0
    try:
        while True:
            body = await _payload(source, run)
            if body != last:
                await resp.write(f"event: {'missing' if body is None else 'view'}\ndata: {body or '{}'}\n\n".encode())
                last, quiet = body, 0.0
            elif quiet >= KEEPALIVE_S:
                await resp.write(b": keepalive\n\n")
                quiet = 0.0
            await asyncio.sleep(every)
            quiet += every
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return resp


async def start(valkey_url: str, host: str, port: int, interval_s: float = 1.0) -> tuple[web.AppRunner, str]:
    r = aioredis.Redis.from_url(valkey_url)
    app = make_app(ValkeyLiveSource(r), interval_s)

    async def _close(_app: web.Application) -> None:
        await r.aclose()

    app.on_cleanup.append(_close)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, f"http://{host}:{bound}/"


async def serve(valkey_url: str, host: str, port: int, port_file: Path | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever); the bound URL goes to `port_file` once serving."""
    runner, url = await start(valkey_url, host, port)
    if port_file:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(url)
        tmp.replace(port_file)
    log.warning("dashboard on %s", url)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


def serve_in_thread(valkey_url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> str:
    """Serve from a daemon thread of this process (a run with backend.dashboard = true); returns the URL.
    Raises OSError when the port is taken."""
    started: dict = {}
    ready = threading.Event()

    def _main() -> None:
        loop = asyncio.new_event_loop()
        try:
            started["url"] = loop.run_until_complete(start(valkey_url, host, port))[1]
        except OSError as e:
            started["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()

    threading.Thread(target=_main, name="dashboard", daemon=True).start()
    ready.wait(10)
    if "error" in started:
        raise started["error"]
    if "url" not in started:
        raise OSError(f"the dashboard did not start on {host}:{port}")
    return started["url"]
