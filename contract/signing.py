"""Message authentication: who may say what to the results writer.

- A task's messages (its ledger batches, its result, their S3 copies) are signed with its attempt's key,
  HMAC(run secret, attempt id), handed to the task at launch (ATTEMPT_KEY_ENV). It cannot sign for another attempt:
  that would take the run secret, which only the dispatcher and the writer hold.
- Verdicts are signed with the verdict key (VERDICT_KEY_ENV), which only the eval fleet and the writer hold, and
  travel on the run's verdict queue, which only the eval role may send to.

The signature covers the exact body bytes and travels beside them (an SQS message attribute, S3 object
metadata), so the body keeps the contract's shape and the writer checks the bytes it received, not a re-encoding.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contract.models import AttemptRef

# Keys are text (hex locally, a Secrets Manager string on AWS), used as their UTF-8 bytes; env values are that text.
ATTEMPT_KEY_ENV = "EVALPLANE_ATTEMPT_KEY"  # the task runner's and its shim's, never the agent's
VERDICT_KEY_ENV = "EVALPLANE_VERDICT_KEY"  # the eval workers' (an ECS secret on AWS), never a task's
MIN_KEY_CHARS = 32
SIG_ATTRIBUTE = "evalplane-sig"  # the SQS message attribute, and the S3 metadata key, holding a signature
REJECTED_ATTRIBUTE = "evalplane-rejected"  # why the writer dead-lettered a message
_VERSION = "v1="

Signer = Callable[[str | bytes], str]


def attempt_id(ref: AttemptRef) -> str:
    return f"{ref.run}/{ref.instance_id}/{ref.attempt}"


def attempt_key(run_secret: bytes, ref: AttemptRef) -> bytes:
    """The key of one attempt: what its task signs with. Derived, so the writer needs only the run secret."""
    return hmac.new(run_secret, b"attempt:" + attempt_id(ref).encode(), hashlib.sha256).hexdigest().encode()


def valkey_password(run_secret: bytes) -> str:
    """The run's Valkey user's password (derived: a resumed dispatcher recreates the same user)."""
    return hmac.new(run_secret, b"valkey", hashlib.sha256).hexdigest()


def gateway_key(run_secret: bytes) -> str:
    """The run's gateway key (derived: a resumed dispatcher mints the same key again)."""
    return "sk-run-" + hmac.new(run_secret, b"gateway", hashlib.sha256).hexdigest()


def sign(key: bytes, body: str | bytes) -> str:
    data = body.encode() if isinstance(body, str) else body
    return _VERSION + hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(key: bytes, body: str | bytes, signature: str | None) -> bool:
    return bool(signature) and hmac.compare_digest(sign(key, body), signature)


def signer(key: bytes) -> Signer:
    return lambda body: sign(key, body)


def key_from_env(name: str) -> bytes | None:
    """A key from the environment (None if unset); a short one is an error naming the variable."""
    value = os.environ.get(name)
    if not value:
        return None
    if len(value) < MIN_KEY_CHARS:
        raise ValueError(f"{name}: a key of at least {MIN_KEY_CHARS} characters is required")
    return value.encode()


def load_or_create_key(path: Path, nbytes: int = 32) -> bytes:
    """A secret kept in a 0600 file (as hex text), made on first use; concurrent first uses agree on one
    (O_EXCL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(nbytes).hex())
    for _ in range(100):  # another process may be between its create and its write
        text = path.read_text().strip()
        if text:
            if path.stat().st_mode & 0o077:
                raise PermissionError(f"{path}: a secret readable by others (mode {path.stat().st_mode & 0o777:o})")
            if len(text) < MIN_KEY_CHARS:
                raise ValueError(f"{path}: a key of at least {MIN_KEY_CHARS} characters is required")
            return text.encode()
        import time

        time.sleep(0.01)
    raise RuntimeError(f"{path}: empty key file")


class RunKeys:
    """What the results writer checks messages with: the run secret (attempt keys derive from it) and the verdict
    key. Never handed to a task."""

    def __init__(self, run_secret: bytes, verdict_key: bytes):
        if not run_secret or not verdict_key:
            raise ValueError("RunKeys: the run secret and the verdict key are both required")
        self.run_secret, self.verdict_key = run_secret, verdict_key

    def attempt_key(self, ref: AttemptRef) -> bytes:
        return attempt_key(self.run_secret, ref)

    def attempt_signer(self, ref: AttemptRef) -> Signer:
        return signer(self.attempt_key(ref))

    @classmethod
    def load(cls, run_secret_file: str | Path, verdict_key_file: str | Path) -> RunKeys:
        """From their 0600 files (made on first use)."""
        return cls(load_or_create_key(Path(run_secret_file)), load_or_create_key(Path(verdict_key_file)))
