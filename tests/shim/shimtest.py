"""Helpers for the shim tests (imported by conftest and tests; a unique module name on sys.path)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai

from plumbing.services import Service
from shim.config import ShimConfig

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM_KEY = f"sk-upstream-{uuid.uuid4().hex}"
LOCAL_TOKEN = "local-harness-token"

FAST_RETRIES = {"backoff_base_s": 0.02, "backoff_cap_s": 0.2, "max_retry_after_s": 0.05}


@dataclass
class ShimProc:
    service: Service
    base: str
    cfg: ShimConfig
    dir: Path

    @property
    def proc(self) -> subprocess.Popen:
        return self.service.proc

    @property
    def ledger_path(self) -> Path:
        return self.cfg.ledger_path

    def rows(self) -> list[dict]:
        """The ledger, once no call is in flight (a client may finish reading before the shim has)."""
        if self.proc.poll() is None:
            deadline = time.monotonic() + 60  # a bound for a loaded machine, not a measure
            while self.status()["in_flight"] and time.monotonic() < deadline:
                time.sleep(0.02)
        if not self.ledger_path.exists():
            return []
        return [json.loads(line) for line in self.ledger_path.read_text().splitlines() if line.strip()]

    def status(self) -> dict:
        return httpx.get(f"{self.base}/_shim/status", timeout=10).json()

    def log(self) -> str:
        return (self.dir / "stderr.log").read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def openai(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=LOCAL_TOKEN, max_retries=0, **kw)

    def anthropic(self, **kw) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base, api_key=LOCAL_TOKEN, max_retries=0, **kw)


def sim_stats(url: str, model: str) -> dict:
    return httpx.get(f"{url}/_sim/stats", timeout=10).json()["models"].get(model, {})


# ------------------------------------------------------------------ a scripted upstream stub

ANTHROPIC_OK = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
    "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 11, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 2},
}
LITELLM_OVERLOADED_500 = {
    "error": {
        "message": 'litellm.InternalServerError: AnthropicError - {"type":"error","error":{"type":"overloaded_error",'
                   '"message":"Overloaded"}}',
        "type": None, "param": None, "code": "500",
    }
}


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_stream(text: str = "hello world", input_tokens: int = 11, output_tokens: int = 3) -> bytes:
    start = {**ANTHROPIC_OK, "content": [], "stop_reason": None,
             "usage": {**ANTHROPIC_OK["usage"], "input_tokens": input_tokens, "output_tokens": 1}}
    return b"".join([
        sse("message_start", {"type": "message_start", "message": start}),
        sse("content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": text}}),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                              "usage": {"output_tokens": output_tokens}}),
        sse("message_stop", {"type": "message_stop"}),
    ])


@contextmanager
def running_stub(script: list[tuple[int, dict, bytes | dict]]):
    """Upstream answering with the scripted (status, headers, body) in order, the last one forever.
    Yields (base_url, seen) where seen lists the requests' (path, headers, json)."""
    from aiohttp import web

    from simulator.testing import running_app

    seen: list[tuple[str, dict, dict]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, dict(request.headers), await request.json()))
        status, headers, body = script[min(len(seen) - 1, len(script) - 1)]
        if isinstance(body, dict):
            return web.json_response(body, status=status, headers=headers)
        if headers.get("content-type") == "text/event-stream":
            resp = web.StreamResponse(status=status, headers=headers)
            await resp.prepare(request)
            await resp.write(body)
            await resp.write_eof()
            return resp
        return web.Response(status=status, body=body, headers=headers)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    with running_app(app) as url:
        yield url, seen


def self_signed_cert(tmp_path: Path) -> tuple[Path, Path]:
    """(key, cert) for CN=localhost, made with openssl (skips the test where openssl is missing)."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return key, cert
