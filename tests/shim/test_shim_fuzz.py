"""Bad requests get a clear 4xx and a ledger row; arbitrary bodies, headers and paths never crash the shim
(a 5xx or a dropped connection counts as a crash)."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shimtest import LOCAL_TOKEN

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"model": st.one_of(st.text(max_size=8), st.integers(), st.none()),
         "messages": st.one_of(json_values, st.just([{"role": "user", "content": "hi"}]))},
        optional={"max_tokens": st.one_of(st.integers(-5, 50), st.text(max_size=3)),
                  "stream": st.one_of(st.booleans(), st.integers(0, 2)),
                  "stream_options": json_values, "system": json_values},
    ).map(lambda d: json.dumps(d).encode()),
)
token = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)
headers = st.dictionaries(token.filter(lambda h: h not in ("content-length", "host", "transfer-encoding")),
                          st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30)
                          .map(lambda v: v or "x"), max_size=4)  # what an HTTP client can send
paths = st.sampled_from(["/v1/messages", "/v1/chat/completions", "/messages", "/chat/completions", "/v1/embeddings",
                         "/", "/v1/messages/count_tokens", "/_shim/status"])


def test_bad_requests_are_clear_4xx_with_a_ledger_row(sim, shim):
    s = shim(sim(), max_body_bytes=64 * 1024)
    auth = {"x-api-key": LOCAL_TOKEN}
    cases = [
        (b"{oops", 400, "not valid JSON"),
        (json.dumps({"messages": []}).encode(), 400, "model"),
        (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}]}).encode(), 413,
         "exceeds"),
    ]
    for body, status, text in cases:
        r = httpx.post(f"{s.base}/v1/messages", headers=auth, content=body)
        assert r.status_code == status and text in r.json()["error"]["message"], r.text
        assert r.headers["x-should-retry"] == "false"
    r = httpx.get(f"{s.base}/v2/whatever", headers=auth)
    assert r.status_code == 404 and "unknown route" in r.json()["error"]["message"]
    rows = s.rows()
    assert [(row["http_status"], row["outcome"]) for row in rows] == [
        (400, "bad_request"), (400, "bad_request"), (413, "bad_request"), (404, "bad_request")]


def test_fuzzed_requests_never_crash_the_shim(sim, shim):
    s = shim(sim(), max_body_bytes=64 * 1024)
    client = httpx.Client(timeout=30)
    sent = {"n": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies, extra=headers, path=paths, method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]),
           auth=st.sampled_from(["x-api-key", "authorization", None]))
    def one(body, extra, path, method, auth):
        h = dict(extra)
        if auth == "x-api-key":
            h["x-api-key"] = LOCAL_TOKEN
        elif auth == "authorization":
            h["authorization"] = f"Bearer {LOCAL_TOKEN}"
        r = client.request(method, s.base + path, content=body, headers=h)  # raises if the connection drops
        assert r.status_code < 500, (r.status_code, r.text[:300])
        if not (path.startswith("/_shim") and method == "GET"):  # the shim's own status page is not a call
            sent["n"] += 1

    one()
    assert s.proc.poll() is None, s.log()
    assert "internal error" not in s.log() and "Traceback" not in s.log()
    assert len(s.rows()) == sent["n"]  # every request has its ledger row
    client.close()
