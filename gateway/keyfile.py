"""The gateway's provider keys: a 0600 JSON file {name: key} that only the gateway processes and the operator (the
local dispatcher) read. Deployments name a key; the key itself never leaves this file for a task or the database."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


def read(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def put(path: Path, name: str, key: str) -> None:
    """Add or replace one key (under a lock: two dispatchers may add theirs at once), rewritten atomically 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = read(path)
        if found.get(name) == key:
            return
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(found | {name: key}, f)
        os.replace(tmp, path)
