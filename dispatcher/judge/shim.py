"""The shim as the judge's child process, one per judged trajectory: `python -m shim --config FILE` with the judge's
key in its environment only (SHIM_UPSTREAM_KEY), as harness/task.py starts it in an agent task. It meters and caps
the judge's calls like an agent's (the judge's run cap across all its shims in Valkey, a per-trajectory cap) and
writes their ledger rows (contract.models.CallRecord) to a file: the judge's spend record."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from contract import task_shape
from contract.models import AttemptLimits, AttemptRef, CallRecord

SHIM_KEY_ENV = "SHIM_UPSTREAM_KEY"


class ShimStartFailed(RuntimeError):
    pass


class JudgeShim:
    def __init__(self, workdir: Path, *, ref: AttemptRef, upstream_url: str, provider: str, model: str, pool: str,
                 key: str, valkey_url: str | None, limits: AttemptLimits, run_cost_usd: float | None,
                 start_timeout_s: float = 60.0):
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.provider, self.model = workdir, provider, model
        self.token = "local-" + secrets.token_hex(16)
        self.ledger = workdir / "ledger.jsonl"
        port_file, self.status_file = workdir / "shim.port", workdir / "shim.status.json"
        port_file.unlink(missing_ok=True)
        cfg = {"upstream_url": upstream_url, "provider": provider, "model": model, "pool": pool,
               "ref": ref.model_dump(), "local_token": self.token, "ledger_path": str(self.ledger),
               "valkey_url": valkey_url, "results_queue_url": None, "limits": limits.model_dump(),
               "run_cost_usd": run_cost_usd, "port_file": str(port_file), "status_path": str(self.status_file)}
        (workdir / "shim.json").write_text(json.dumps(cfg))
        # Only the shim holds the key: neither the run's key nor ours is passed on under another name.
        env = {k: v for k, v in os.environ.items() if k not in (task_shape.UPSTREAM_KEY_ENV, SHIM_KEY_ENV)}
        self._log = open(workdir / "shim.log", "ab")  # noqa: SIM115 - the child writes it until stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "shim", "--config", str(workdir / "shim.json")],
                                     env=env | {SHIM_KEY_ENV: key}, stdout=self._log, stderr=self._log,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ShimStartFailed(f"the judge's shim did not start; see {workdir / 'shim.log'}")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port_file.read_text().strip()}"

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
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
