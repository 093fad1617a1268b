"""The local backend's S3/SQS server (dispatcher/backends/daemons.py): a working server on its port is reused; one that
answers but does not serve S3 (a server left by a deleted checkout answers 500 to every call) is not."""

from __future__ import annotations

import http.server
import threading

import pytest

from dispatcher.backends import daemons
from tests.conftest import free_port


class Broken(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(500, "ModuleNotFoundError")

    def log_message(self, *args):
        pass


@pytest.fixture
def local_port(monkeypatch, tmp_path):
    port = free_port()
    monkeypatch.setattr(daemons, "MOTO_PORT", port)
    monkeypatch.setenv("EVALPLANE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    yield port
    daemons.stop_moto()


def test_a_server_that_answers_but_does_not_serve_s3_is_refused_naming_the_port(local_port):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", local_port), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match=f"port {local_port} answers, but not as an S3/SQS server"):
            daemons.ensure_moto()
    finally:
        server.shutdown()
        server.server_close()


def test_its_own_server_is_started_then_reused(local_port, tmp_path, monkeypatch):
    endpoint = daemons.ensure_moto()
    assert endpoint == f"http://127.0.0.1:{local_port}" and daemons._serves_s3(endpoint)
    pid = (tmp_path / "moto.pid").read_text()
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert daemons.ensure_moto() == endpoint and (tmp_path / "moto.pid").read_text() == pid  # not restarted
