"""The package index a grading container may reach, and nothing else: proxpi, a caching pull-through proxy.

The official eval scripts run `python -m pip install -e .`, whose build isolation fetches the build requirements
from a package index. A grading container reaches nothing of the control plane (eval_worker.docker_backend puts it
on a network whose only way out leads here, with PIP_INDEX_URL set to it), so the project serves the index itself:
proxpi (PyPI: `proxpi`) in front of the index this machine's pip is configured with, caching what it serves under
the state folder. On AWS the estate runs the same proxy in its build tier and hands its URL to the eval workers
(EVALPLANE_PACKAGE_INDEX; docs/infra.md).

  python -m eval_worker.package_index --host H --port P    serve (dispatcher.backends.daemons starts it as a daemon)
"""

from __future__ import annotations

import argparse
import os
import urllib.error
import urllib.request

PACKAGE_INDEX_ENV = "EVALPLANE_PACKAGE_INDEX"  # the index's simple-API URL, as a grading's pip is to use it
PROBE_PROJECT = "pip"  # what a health check asks the index for: served from upstream or from the cache
# The proxy's own health (its cache folder still there), not its upstream's: whether a running daemon is restarted
# is decided on this, so that an upstream's slow answer never restarts an index under a running grading
HEALTH_PATH = "/_health"
# proxpi waits this long for a file it is fetching before it redirects the client to the upstream, which a grading
# cannot reach: long enough for the largest wheels, so it never redirects
DOWNLOAD_TIMEOUT_S = 300


def proxpi_settings(cache_dir: str, index: str = "", extra: tuple[str, ...] = (),
                    cache_bytes: int | None = None) -> dict[str, str]:
    """proxpi's environment, the same here and in the estate's index tasks (components/package_index.py).
    index "": proxpi's default upstream (PyPI's simple API)."""
    env = {"PROXPI_CACHE_DIR": cache_dir, "PROXPI_DOWNLOAD_TIMEOUT": str(DOWNLOAD_TIMEOUT_S),
           "PROXPI_CONNECT_TIMEOUT": "10", "PROXPI_READ_TIMEOUT": "60"}
    if cache_bytes is not None:
        env["PROXPI_CACHE_SIZE"] = str(cache_bytes)
    if index:
        env["PROXPI_INDEX_URL"] = index
    if extra:
        env["PROXPI_EXTRA_INDEX_URLS"] = ",".join(extra)
    return env


def upstream() -> tuple[str, list[str]]:
    """(index URL, extra index URLs) this machine's pip uses: its environment and configuration files, else PyPI's.
    Extra indexes that are not HTTP (a local folder) are left out: the proxy serves over HTTP what it fetches."""
    from pip._internal.configuration import Configuration, ConfigurationError
    from pip._internal.models.index import PyPI

    config = Configuration(isolated=False)
    config.load()

    def value(key: str) -> str:
        env = os.environ.get(f"PIP_{key.upper().replace('-', '_')}")
        if env:
            return env
        for section in (":env:", "global", "install"):
            try:
                return str(config.get_value(f"{section}.{key}"))
            except ConfigurationError:
                continue
        return ""

    index = value("index-url") or PyPI.simple_url
    extra = [u for u in value("extra-index-url").split() if u.startswith(("http://", "https://"))]
    return _folder(index), [_folder(u) for u in extra]


def _folder(url: str) -> str:
    return url if url.endswith("/") else url + "/"  # the proxy joins project names onto it


def available(url: str, timeout: float = 30.0) -> bool:
    """The index answers for a project (the proxy is up and its upstream or its cache can serve)."""
    return _answers_200(urllib.request.Request(url.rstrip("/") + f"/{PROBE_PROJECT}/", headers={"Accept": "text/html"}),
                        timeout)


def _answers_200(req: urllib.request.Request | str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError, urllib.error.URLError):
        return False


def url_for(host: str, port: int) -> str:
    return f"http://{host}:{port}/index/"


def healthy(url: str, timeout: float = 10.0) -> bool:
    """The index at `url` (url_for's) is this project's, and its cache folder is in place."""
    return _answers_200(url.rstrip("/").removesuffix("/index") + HEALTH_PATH, timeout)


def simple_api_only(app, cache_dir: str | None = None):
    """The WSGI app answering only what pip reads (GET and HEAD under /index/) and its own health (HEALTH_PATH):
    proxpi's cache-invalidation routes are not a grading's to call (on AWS the load balancer's listener rule does
    the same)."""

    def wrapped(environ, start_response):
        method, path = environ.get("REQUEST_METHOD"), environ.get("PATH_INFO", "")
        if method in ("GET", "HEAD") and path.startswith("/index/"):
            return app(environ, start_response)
        if method == "GET" and path == HEALTH_PATH:
            ok = cache_dir is None or os.access(cache_dir, os.W_OK)
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"the cache folder is gone\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return wrapped


def serve(host: str, port: int, cache_dir: str) -> None:
    index, extra = upstream()
    os.environ.update(proxpi_settings(cache_dir, index, tuple(extra)))
    from proxpi.server import app  # reads its configuration from the environment when imported
    from werkzeug.serving import run_simple

    run_simple(host, port, simple_api_only(app, cache_dir), threaded=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m eval_worker.package_index", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cache-dir", required=True)
    args = ap.parse_args(argv)
    serve(args.host, args.port, args.cache_dir)


if __name__ == "__main__":
    main()
