"""Raw HTTP calls and SSE parsing for the simulator tests, next to the official SDKs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str

    def json(self) -> dict:
        return json.loads(self.text)

    def events(self) -> list[tuple[str | None, str]]:
        """The SSE events as (event name, data) pairs."""
        out = []
        for block in self.text.strip().split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.splitlines())
            out.append((fields.get("event"), fields["data"]))
        return out


def post(url: str, body: dict | bytes, headers: dict[str, str] | None = None) -> Answer:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return Answer(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode())


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


OPENAI = {"Authorization": "Bearer test-key"}
ANTHROPIC = {"x-api-key": "test-key", "anthropic-version": "2023-06-01"}
