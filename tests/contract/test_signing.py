"""contract/signing.py: keys in 0600 files, per-attempt keys, signatures over the exact bytes; and the Valkey URL
helpers the tasks and the dispatcher use (contract/valkey_auth.py)."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from contract import signing, valkey_auth
from contract.models import AttemptRef


def test_a_key_file_is_made_once_0600_and_refused_when_others_can_read_it(tmp_path):
    path = tmp_path / "keys" / "run.key"
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(signing.load_or_create_key(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got[0]) == 64  # concurrent first uses agree on one key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        signing.load_or_create_key(path)


def test_attempt_keys_differ_per_attempt_and_per_run_and_signatures_cover_the_exact_bytes():
    secret = os.urandom(32).hex().encode()
    a, b = AttemptRef(run="r", instance_id="x", attempt=1), AttemptRef(run="r", instance_id="x", attempt=2)
    keys = {signing.attempt_key(secret, a), signing.attempt_key(secret, b),
            signing.attempt_key(os.urandom(32).hex().encode(), a)}
    assert len(keys) == 3
    k = signing.attempt_key(secret, a)
    body = '{"msg": {"kind": "ledger"}}'
    sig = signing.sign(k, body)
    assert signing.verify(k, body, sig) and signing.verify(k, body.encode(), sig)
    assert not signing.verify(k, body + " ", sig)  # one byte more
    assert not signing.verify(signing.attempt_key(secret, b), body, sig)
    assert not signing.verify(k, body, None) and not signing.verify(k, body, "")


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.delenv(signing.VERDICT_KEY_ENV, raising=False)
    assert signing.key_from_env(signing.VERDICT_KEY_ENV) is None
    monkeypatch.setenv(signing.VERDICT_KEY_ENV, "short")
    with pytest.raises(ValueError, match=signing.VERDICT_KEY_ENV):
        signing.key_from_env(signing.VERDICT_KEY_ENV)
    monkeypatch.setenv(signing.VERDICT_KEY_ENV, "k" * 40)
    assert signing.key_from_env(signing.VERDICT_KEY_ENV) == b"k" * 40


def test_valkey_urls_take_the_environments_user_and_never_give_theirs_away(monkeypatch):
    monkeypatch.setenv(valkey_auth.USER_ENV, "ep-run-r")
    monkeypatch.setenv(valkey_auth.PASSWORD_ENV, "p@ss/word:1")
    assert valkey_auth.with_credentials("rediss://h.invalid:6379/0") == "rediss://ep-run-r:p%40ss%2Fword%3A1@h.invalid:6379/0"
    assert valkey_auth.with_credentials("redis://a:b@h.invalid:1/0") == "redis://a:b@h.invalid:1/0"  # kept as it is
    assert valkey_auth.without_credentials("redis://admin:secret@127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"
    monkeypatch.setenv("VALKEY_URL", "rediss://h.invalid:6379/0")
    assert valkey_auth.default_url() == "rediss://ep-run-r:p%40ss%2Fword%3A1@h.invalid:6379/0"
    # names are literal in ACL patterns (a pool name with glob characters matches only itself)
    rules = valkey_auth.run_user_rules("r", "m*[x]?@h", "pw")
    assert "~ep:pool:{m\\*\\[x\\]\\?@h}:pacer" in rules and "~ep:run:{r}:*" in rules
