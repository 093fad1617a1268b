"""The bench's yardsticks do what they stand for. Its pinning relays (bench/tcp_relay.py --pin, bench/compiled_relay
--pin and --scan-pin) are the floors the shim's long-prompt row is read against, so each must do at least what the
shim does to a request's model: every top-level "model" key replaced, however spelled, the rest of the body and
nested "model"s kept, Content-Length made right, and requests on a kept-alive connection each handled. The data
plane prototype (compiled_relay --dataplane) stands for the shim's path compiled."""

from __future__ import annotations

import functools
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "claude-sonnet-4-5"


def _read_request(conn: socket.socket, buf: bytearray) -> tuple[bytes, bytes]:
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        assert chunk, "connection closed before a whole head"
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    head = bytes(buf[:end])
    size = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                if line.lower().startswith(b"content-length:"))
    while len(buf) < end + 4 + size:
        chunk = conn.recv(65536)
        assert chunk, "connection closed before a whole body"
        buf += chunk
    body = bytes(buf[end + 4:end + 4 + size])
    del buf[:end + 4 + size]
    return head, body


@pytest.fixture
def upstream():
    """A server that records each request (head, body) it gets and answers it with a small 200."""
    seen: list[tuple[bytes, bytes]] = []
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        buf = bytearray()
        with conn:
            try:
                while True:
                    seen.append(_read_request(conn, buf))
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            except (AssertionError, OSError):
                pass

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1], seen
    srv.close()


@functools.cache
def _compiled() -> list[str]:
    """The compiled relay, built after its unit tests passed (its scanner against serde_json's verdicts)."""
    path = subprocess.run(["bash", str(ROOT / "scripts" / "build_compiled_relay.sh"), "--test"], check=True,
                          stdout=subprocess.PIPE, text=True).stdout.strip()
    return [path]


@pytest.fixture(params=["python", "compiled", "compiled scanner"])
def pinning_relay(request, upstream):
    port, seen = upstream
    cmd = [sys.executable, str(ROOT / "bench" / "tcp_relay.py")] if request.param == "python" else _compiled()
    flag = "--scan-pin" if request.param == "compiled scanner" else "--pin"
    proc = subprocess.Popen([*cmd, "127.0.0.1", str(port), flag, MODEL], stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline()), seen
    finally:
        proc.kill()
        proc.wait()


def _post(sock: socket.socket, body: bytes) -> None:
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\nX-Other: 1\r\n\r\n%s"
                 % (len(body), body))
    answer = b""
    while not answer.endswith(b"ok"):
        chunk = sock.recv(4096)
        assert chunk, "the relay closed the connection"
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK")


def test_pinning_relay_pins_every_spelling_of_the_model(pinning_relay):
    port, seen = pinning_relay
    prompt = "text with \"model\": \"x\" in it and a \\u escape " * 2000
    bodies = [
        # duplicate keys: a JSON reader upstream would take the last one
        b'{"model": "anthropic/claude-sonnet-4-5", "max_tokens": 64, "model": "opus",'
        b' "messages": [{"role": "user", "content": ' + json.dumps(prompt).encode() + b'}],'
        b' "metadata": {"model": "nested stays"}}',
        # the key spelled with an escape
        b'{"mod\\u0065l": "opus", "max_tokens": 8, "messages": []}',
    ]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for body in bodies:
            _post(sock, body)
    assert len(seen) == 2
    for (head, sent), original in zip(seen, bodies):
        assert sent.count(b'"model"') == 1 + (b'"nested stays"' in original), sent[:200]
        assert b"mod\\u0065l" not in sent
        doc, orig = json.loads(sent), json.loads(original)
        assert doc["model"] == MODEL
        assert {k: v for k, v in doc.items() if k != "model"} == {k: v for k, v in orig.items() if k != "model"}
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/messages HTTP/1.1" and b"X-Other: 1" in lines
        assert [int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length:")] == [len(sent)]
    assert json.loads(seen[0][1])["metadata"] == {"model": "nested stays"}
    assert json.loads(seen[0][1])["messages"][0]["content"] == prompt


def test_dataplane_prototype_does_the_shims_path(tmp_path):
    """bench_shim.py --compiled measures compiled_relay --dataplane as the shim's path compiled: so it must take only
    the local token, send the real key, pin the model, hold a stream's events until its first content, and record
    each call's usage, against the real simulator."""
    import anthropic
    import httpx

    from simulator import SimulatorConfig
    from simulator.testing import simulator_process

    key, token = "sk-real-" + "x" * 20, "local-token"
    records = tmp_path / "records.jsonl"
    with simulator_process(SimulatorConfig(api_key=key, rpm=0, itpm=0, otpm=0)) as sim:
        host, port = sim.removeprefix("http://").split(":")
        proc = subprocess.Popen([*_compiled(), host, port, "--dataplane", MODEL, token], stdout=subprocess.PIPE,
                                text=True, env={"DATAPLANE_UPSTREAM_KEY": key, "DATAPLANE_RECORDS": str(records)})
        try:
            base = f"http://127.0.0.1:{int(proc.stdout.readline())}"
            client = anthropic.Anthropic(base_url=base, api_key=token, max_retries=0)
            ask = {"model": "anthropic/alias", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
            answer = client.messages.create(**ask)
            assert answer.model == MODEL and answer.usage.output_tokens > 0
            with client.messages.stream(**ask) as stream:
                text = "".join(stream.text_stream)
                final = stream.get_final_message()
            assert text and final.model == MODEL
            with pytest.raises(anthropic.AuthenticationError):
                anthropic.Anthropic(base_url=base, api_key=key, max_retries=0).messages.create(**ask)
            bad = httpx.post(f"{base}/v1/messages", content=b"{not json", headers={"x-api-key": token})
            assert bad.status_code == 400 and bad.headers["x-should-retry"] == "false"
        finally:
            proc.kill()
            proc.wait()
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(r["status"], r["stream"], r["max_tokens"]) for r in rows] == [(200, False, 32), (200, True, 32)]
    assert rows[0]["output_tokens"] == answer.usage.output_tokens
    assert rows[1]["output_tokens"] == final.usage.output_tokens
    assert rows[1]["input_tokens"] + rows[1]["cached_tokens"] == final.usage.input_tokens + (
        final.usage.cache_read_input_tokens or 0)
