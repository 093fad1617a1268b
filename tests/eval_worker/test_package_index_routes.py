"""The package index's own routes (eval_worker.package_index.simple_api_only): pip's reads pass to proxpi, its
health says whether the proxy's cache folder is in place (not whether its upstream answers: that decides whether a
running daemon is restarted under a grading), and nothing else answers."""

from __future__ import annotations

import shutil
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from eval_worker.package_index import HEALTH_PATH, healthy, simple_api_only, url_for


class Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


def call(app, method: str, path: str) -> tuple[str, bytes]:
    seen = {}

    def start_response(status, headers):
        seen["status"] = status

    body = b"".join(app({"REQUEST_METHOD": method, "PATH_INFO": path}, start_response))
    return seen["status"], body


def proxpi(environ, start_response):
    start_response("200 OK", [])
    return [b"proxpi " + environ["PATH_INFO"].encode()]


def test_health_is_the_cache_folders_and_only_pips_reads_reach_proxpi(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    app = simple_api_only(proxpi, str(cache))
    assert call(app, "GET", "/index/pip/") == ("200 OK", b"proxpi /index/pip/")
    assert call(app, "HEAD", "/index/pip/")[0] == "200 OK"
    assert call(app, "GET", HEALTH_PATH)[0] == "200 OK"
    for method, path in (("POST", "/index/pip/"), ("DELETE", "/cache/pip"), ("GET", "/"), ("POST", HEALTH_PATH)):
        assert call(app, method, path)[0] == "404 Not Found", (method, path)
    shutil.rmtree(cache)  # a daemon whose state folder was deleted: restarted by the next ensure_package_index
    assert call(app, "GET", HEALTH_PATH)[0] == "503 Service Unavailable"


def test_healthy_asks_the_health_route_of_the_index_url(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    server = make_server("127.0.0.1", 0, simple_api_only(proxpi, str(cache)), handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = url_for("127.0.0.1", server.server_port)
        assert healthy(url)
        shutil.rmtree(cache)
        assert not healthy(url)
    finally:
        server.shutdown()
        server.server_close()
    assert not healthy(url, timeout=1)  # nothing answers
