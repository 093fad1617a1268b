"""The dashboard's web app (aiohttp): one page, its JSON, and server-sent events that push a run's view.

  GET /                  the page (static; it follows a run over /events/<run> and the run list over /events)
  GET /api/runs          runs with a live view, newest first
  GET /api/runs/<run>    one run's view (404 if it has none)
  GET /events[/<run>]    server-sent events: the same JSON, sent when it changes (a comment every 15 s keeps the
                         connection open through proxies)
  GET /api/control       whether this dashboard takes control requests at all (it does only with a token)
  POST /api/runs/<run>/control   {"action": "pause" | "resume" | "resize" | "cancel", "concurrency": N,
                         "hold_calls": true (a pause that holds the shims' new model calls too)}, with
                         `Authorization: Bearer <token>`: the run's control state in PostgreSQL (dispatcher.store)

Without a token the dashboard is read-only: every control request is refused. The token is the dashboard's own
(printed when it starts, or read from a 0600 file: load_token), compared in constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import stat
import threading
from importlib import resources
from pathlib import Path

import redis
import redis.asyncio as aioredis
from aiohttp import web

from dispatcher.dashboard.view import LiveSource, ValkeyLiveSource

log = logging.getLogger("evalplane.dashboard")

SOURCE = web.AppKey("source", LiveSource)
INTERVAL = web.AppKey("interval_s", float)
TOKEN = web.AppKey("token", str)
VALKEY_URL = web.AppKey("valkey_url", str)  # where a resume lifts a run's call hold (the shims read it there)
KEEPALIVE_S = 15.0
DEFAULT_PORT = 8270
ACTIONS = ("pause", "resume", "resize", "cancel")


class TokenFileError(Exception):
    """The token file is open to other users (it must be 0600) or unreadable."""


def load_token(path: Path | None) -> str:
    """The dashboard's control token: a new one (path None), or the one in `path`, created 0600 if missing. A file
    other users can read or write is refused: its token would be theirs too."""
    if path is None:
        return secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise TokenFileError(f"{path} is mode {mode:04o}; a token file must be 0600") from None
        token = path.read_text().strip()
        if not token:
            raise TokenFileError(f"{path} is empty") from None
        return token
    with os.fdopen(fd, "w") as f:
        token = secrets.token_urlsafe(32)
        f.write(token + "\n")
    return token


def make_app(source: LiveSource, interval_s: float = 1.0, token: str | None = None,
             valkey_url: str | None = None) -> web.Application:
    """token: control requests bearing it act on runs; None: the dashboard is read-only. valkey_url: the Valkey a
    resume lifts a run's call hold in (`pause --hold-calls`)."""
    app = web.Application()
    app[SOURCE], app[INTERVAL] = source, interval_s
    if token:
        app[TOKEN] = token
    if valkey_url:
        app[VALKEY_URL] = valkey_url
    app.router.add_get("/", _index)
    app.router.add_get("/api/runs", _runs)
    app.router.add_get("/api/runs/{run}", _run)
    app.router.add_get("/api/control", _control_enabled)
    app.router.add_post("/api/runs/{run}/control", _control)
    app.router.add_get("/events", _events)
    app.router.add_get("/events/{run}", _events)
    return app


def _error(cls: type[web.HTTPException], message: str) -> web.HTTPException:
    return cls(text=json.dumps({"error": message}), content_type="application/json")


async def _control_enabled(request: web.Request) -> web.Response:
    return web.json_response({"enabled": TOKEN in request.app})


async def _control(request: web.Request) -> web.Response:
    token = request.app.get(TOKEN)
    if token is None:
        raise _error(web.HTTPForbidden, "this dashboard is read-only (started without a control token)")
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise _error(web.HTTPUnauthorized, "a valid control token is required")
    try:
        body = await request.json()
        action = body["action"]
        concurrency = int(body["concurrency"]) if action == "resize" else None
        hold_calls = body.get("hold_calls", False)
        if not isinstance(hold_calls, bool):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise _error(web.HTTPBadRequest, 'expected {"action": ..., "concurrency": N for resize, "hold_calls": true'
                                         ' or false for pause}') from None
    if action not in ACTIONS or (concurrency is not None and concurrency < 1):
        raise _error(web.HTTPBadRequest, f"action is one of {', '.join(ACTIONS)}; concurrency at least 1")
    run = request.match_info["run"]
    from dispatcher import store  # psycopg: only a dashboard that controls needs the database

    url = request.app.get(VALKEY_URL)

    def act() -> bool:
        with store.connect() as conn, (redis.Redis.from_url(url) if url else contextlib.nullcontext()) as valkey:
            return store.act(conn, run, action, concurrency, valkey, hold_calls=action == "pause" and hold_calls)

    if not await asyncio.to_thread(act):
        raise _error(web.HTTPConflict, f"no running run named {run!r}")
    return web.json_response({"run": run, "action": action, "concurrency": concurrency})


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


async def start(valkey_url: str, host: str, port: int, interval_s: float = 1.0,
                token: str | None = None) -> tuple[web.AppRunner, str]:
    r = aioredis.Redis.from_url(valkey_url)
    app = make_app(ValkeyLiveSource(r), interval_s, token, valkey_url)

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
                stop: asyncio.Event | None = None, token: str | None = None) -> None:
    """Serve until `stop` is set (or forever); the bound URL goes to `port_file` once serving."""
    runner, url = await start(valkey_url, host, port, token=token)
    if port_file:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(url)
        tmp.replace(port_file)
    log.warning("dashboard on %s", url)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


def serve_in_thread(valkey_url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                    token: str | None = None) -> str:
    """Serve from a daemon thread of this process (a run with backend.dashboard = true); returns the URL.
    Raises OSError when the port is taken."""
    started: dict = {}
    ready = threading.Event()

    def _main() -> None:
        loop = asyncio.new_event_loop()
        try:
            started["url"] = loop.run_until_complete(start(valkey_url, host, port, token=token))[1]
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
