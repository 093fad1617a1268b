"""A command that needs a part of the local stack that is down says so in one line, naming the part and
`scripts/stack.sh up`, and exits non-zero without a traceback; a command that does not need that part still works.
The parts are really down: the environment points them at a closed port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
EXIT_STACK_DOWN = 4


def spec(tmp_path: Path, run: str, launcher: str) -> Path:
    f = tmp_path / f"{launcher}.toml"
    f.write_text(f"""
[run]
name = "{run}"
[harness]
name = "mini-swe-agent"
[model]
provider = "openai"
model = "gpt-4o-mini"
[instances]
dataset = "{SYNTHETIC / 'instances.jsonl'}"
repos = "{SYNTHETIC / 'repos'}"
[budget]
run_usd = 1.0
[backend]
kind = "local"
launcher = "{launcher}"
isolate_agent = false
""")
    return f


def dispatcher(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dispatcher", *args], check=False, env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def assert_one_line_naming(p: subprocess.CompletedProcess, part: str) -> None:
    assert p.returncode == EXIT_STACK_DOWN, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert part in lines[0] and "scripts/stack.sh up" in lines[0], lines[0]


@pytest.fixture
def postgres_down(tmp_path) -> dict:
    return {**os.environ, "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/test",
            "EVALPLANE_STATE_DIR": str(tmp_path / "state")}


@pytest.fixture
def valkey_down(tmp_path, database_url) -> dict:
    return {**os.environ, "DATABASE_URL": database_url, "VALKEY_URL": f"redis://admin:pw@127.0.0.1:{free_port()}/0",
            "EVALPLANE_STATE_DIR": str(tmp_path / "state")}


@pytest.mark.parametrize("command", ["validate", "forecast", "plan", "status"])
def test_postgres_down_is_one_line(postgres_down, tmp_path, unique, command):
    # validate needs PostgreSQL where tasks run in task images (their image records); a docker spec, then
    args = [command] if command == "status" else [command, str(spec(tmp_path, unique, "docker"))]
    assert_one_line_naming(dispatcher(postgres_down, *args), "PostgreSQL")


def test_validate_needs_no_database_for_process_tasks(postgres_down, tmp_path, unique):
    p = dispatcher(postgres_down, "validate", str(spec(tmp_path, unique, "process")))
    assert p.returncode == 0 and f"ok: run '{unique}'" in p.stdout, p.stderr


def test_valkey_down_stops_what_needs_it_and_only_that(valkey_down, tmp_path, unique):
    process_spec = str(spec(tmp_path, unique, "process"))
    for args in (["run", process_spec], ["dashboard", "--port", "0"], ["forecast", process_spec],
                 ["plan", process_spec]):
        assert_one_line_naming(dispatcher(valkey_down, *args), "Valkey")
    assert dispatcher(valkey_down, "status").returncode == 0  # PostgreSQL only
    assert dispatcher(valkey_down, "validate", process_spec).returncode == 0
    assert not (tmp_path / "state" / "runs" / unique).exists()  # the refused run started nothing


def test_valkey_unset_and_not_started_is_one_line(tmp_path, database_url):
    env = {k: v for k, v in os.environ.items() if k != "VALKEY_URL"}
    env |= {"DATABASE_URL": database_url, "EVALPLANE_STATE_DIR": str(tmp_path / "state")}  # no admin.url there
    assert_one_line_naming(dispatcher(env, "dashboard", "--port", "0"), "Valkey")
