"""The shim as the judge's child process, one per judged trajectory: `python -m shim --config FILE` with the judge's
key in its environment only (SHIM_UPSTREAM_KEY), as harness/task.py starts it in an agent task. It meters and caps
the judge's calls like an agent's (the judge's run cap across all its shims in Valkey, a per-trajectory cap) and
writes their ledger rows (contract.models.CallRecord) to a file: the judge's spend record."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from contract.models import AttemptLimits, AttemptRef, CallRecord
from plumbing.services import ServiceFailed
from shim.child import shim_service
from shim.config import ShimConfig


class ShimStartFailed(ServiceFailed):
    pass


class JudgeShim:
    def __init__(self, workdir: Path, *, ref: AttemptRef, upstream_url: str, provider: str, model: str, pool: str,
                 key: str, upstream_model: str | None = None, valkey_url: str | None, limits: AttemptLimits, run_cost_usd: float | None,
                 start_timeout_s: float = 60.0):
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.provider, self.model = workdir, provider, model
        self.token = "local-" + secrets.token_hex(16)
        self.ledger = workdir / "ledger.jsonl"
        self.status_file = workdir / "shim.status.json"
        # upstream_model: the gateway's alias, as harness/task.py's shim sends job.model.alias (priced as `model`)
        cfg = ShimConfig(upstream_url=upstream_url, provider=provider, model=model, upstream_model=upstream_model,
                         pool=pool, ref=ref,
                         local_token=self.token, ledger_path=self.ledger, valkey_url=valkey_url,
                         results_queue_url=None, limits=limits, run_cost_usd=run_cost_usd,
                         port_file=workdir / "shim.port", status_path=self.status_file)
        # Only the shim holds the key: neither the run's key nor ours is passed on under another name.
        self.service = shim_service(cfg, workdir / "shim.json", key, log=workdir / "shim.log",
                                    name="the judge's shim", timeout_s=start_timeout_s, grace_s=60)
        try:
            self.service.start()
        except ServiceFailed as e:
            raise ShimStartFailed(str(e)) from None  # names the log and ends with its tail
        self.proc = self.service.proc
        self.url = f"http://127.0.0.1:{self.service.port}"

    def ask(self, messages: list[dict[str, str]], max_tokens: int, timeout_s: float = 600.0) -> tuple[int, Any]:
        """One call through the shim: (HTTP status, the JSON body)."""
        if self.provider == "anthropic":
            system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
            path, body = "/v1/messages", {"model": self.model, "max_tokens": max_tokens, "system": system,
                                          "messages": [m for m in messages if m["role"] != "system"]}
            headers = {"x-api-key": self.token, "anthropic-version": "2023-06-01"}
        else:
            path, body = "/v1/chat/completions", {"model": self.model, "max_tokens": max_tokens, "messages": messages}
            headers = {"Authorization": f"Bearer {self.token}"}
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers=headers | {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw or b"null")
            except ValueError:
                return e.code, {"error": {"message": raw[:2000].decode(errors="replace")}}

    def stop(self) -> dict:
        """SIGTERM: the shim finishes, writes its ledger and status."""
        self.service.stop()
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}


def ledger_rows(path: Path) -> list[CallRecord]:
    if not path.exists():
        return []
    return [CallRecord.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


def answer_text(provider: str, body: Any) -> str | None:
    """The model's text in a provider's response body (None if the body has none)."""
    try:
        if provider == "anthropic":
            return "".join(b.get("text", "") for b in body["content"] if b.get("type") == "text")
        return body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
