"""What a local task's process is handed (dispatcher/launchers/process.py, as the local backend builds it): the run's
Valkey user and its own attempt key, never the dispatcher's admin Valkey URL, its database URL, nor any URL carrying
a password or secret-looking variable of the dispatcher's environment."""

from __future__ import annotations

import os
import stat
import time

from contract import signing, valkey_auth
from contract.models import AttemptRef
from dispatcher.backends.base import attempt_env
from dispatcher.launchers.process import ProcessLauncher, local_task_env


def test_a_local_task_gets_its_run_user_and_its_attempt_key_only(tmp_path, monkeypatch, run_keys):
    admin = "redis://admin:admin-password-123@127.0.0.1:6390/0"
    monkeypatch.setenv("VALKEY_URL", admin)
    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    monkeypatch.setenv("SOME_SERVICE", "https://user:hunter2hunter2@internal.invalid/")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-operator")
    monkeypatch.setenv("HARMLESS", "http://127.0.0.1:4599")
    env = local_task_env({valkey_auth.USER_ENV: "ep-run-r", valkey_auth.PASSWORD_ENV: "run-password-456"})
    # the task's process, as the launcher starts it ("python" here a script that dumps its environment)
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nenv > "$3.env"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("dispatcher.launchers.process.sys.executable", str(fake))
    launcher = ProcessLauncher(tmp_path / "logs", env, attempt_env(run_keys))
    refs = [AttemptRef(run="r", instance_id=f"i-{n}", attempt=1) for n in (1, 2)]
    handles = [launcher.launch(ref, str(tmp_path / ref.instance_id)) for ref in refs]
    deadline = time.monotonic() + 30
    while any(launcher.poll(h) is None for h in handles):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for ref in refs:
        seen = dict(line.split("=", 1) for line in (tmp_path / f"{ref.instance_id}.env").read_text().splitlines()
                    if "=" in line)
        assert seen[signing.ATTEMPT_KEY_ENV] == run_keys.attempt_key(ref).decode()  # its own key, no other's
        assert seen[valkey_auth.USER_ENV] == "ep-run-r" and seen[valkey_auth.PASSWORD_ENV] == "run-password-456"
        text = (tmp_path / f"{ref.instance_id}.env").read_text()
        for secret in ("admin-password-123", "hunter2hunter2", "sk-operator", "DATABASE_URL", "VALKEY_URL",
                       run_keys.run_secret.decode(), run_keys.verdict_key.decode()):
            assert secret not in text, secret
        assert seen["HARMLESS"] == "http://127.0.0.1:4599"
    assert os.environ["VALKEY_URL"] == admin  # the dispatcher's own environment is left as it was
