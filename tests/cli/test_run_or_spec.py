"""RUN_OR_SPEC: a spec file (a path ending .toml, or any existing file) names its run.name's run; anything else
that is a valid run name is a run's name; the rest is refused. And the console script answers --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dispatcher.cli.errors import EXIT_SPEC, Refused
from dispatcher.cli.target import resolve
from dispatcher.spec import SpecError
from tests.e2e.test_local_run import without_gateway

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "examples" / "local.toml"


def test_a_spec_file_names_its_run():
    it = resolve(str(LOCAL))
    assert (it.run, it.spec_file) == ("local-demo", str(LOCAL))
    assert it.plan is not None and it.plan.spec.run.name == "local-demo"


def test_an_existing_file_is_a_spec_whatever_its_name(tmp_path):
    f = local_spec(tmp_path, "local-demo").rename(tmp_path / "other-run")  # a run's name as a file name: the file
    it = resolve(str(f))
    assert (it.run, it.spec_file) == ("local-demo", str(f))


def test_a_run_name_is_a_run():
    it = resolve("my-run-2")
    assert (it.run, it.spec_file, it.plan) == ("my-run-2", None, None)


def test_a_missing_toml_is_a_spec_problem_not_a_run_name(tmp_path):
    with pytest.raises(SpecError) as e:
        resolve(str(tmp_path / "nope.toml"))
    assert e.value.problems[0].path == "<file>"


def test_neither_is_refused():
    with pytest.raises(Refused) as e:
        resolve("Not A Run!")
    assert e.value.code == EXIT_SPEC and "neither a spec file nor a run name" in e.value.message


def local_spec(tmp_path: Path, run: str) -> Path:
    f = tmp_path / "spec.toml"
    f.write_text(without_gateway(LOCAL.read_text()).replace('"synthetic/', f'"{LOCAL.parent}/synthetic/')
                 .replace('name = "local-demo"', f'name = "{run}"'))
    return f


def test_status_and_cancel_take_a_spec_or_a_run_name(pg, database_url, tmp_path, unique):
    """Both forms reach the same run."""
    from psycopg.types.json import Jsonb

    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts, status) VALUES (%s, %s, 'h', 'local', 5,"
               " 'running')", (unique, Jsonb({})))
    pg.commit()
    env = {"DATABASE_URL": database_url, "PATH": "/usr/bin:/bin", "EVALPLANE_STATE_DIR": str(tmp_path / "state")}

    def dispatcher(*args):
        return subprocess.run([sys.executable, "-m", "dispatcher", *args], check=False, env=env, capture_output=True, text=True,
                              cwd=ROOT, timeout=60)

    spec = str(local_spec(tmp_path, unique))
    for arg in (unique, spec):
        p = dispatcher("status", arg)
        assert p.returncode == 0 and p.stdout.startswith(f"{unique}: running, 0/5 attempts landed"), p.stderr
    assert dispatcher("cancel", spec).returncode == 0
    p = dispatcher("cancel", unique)  # the same run: no longer running
    assert p.returncode == 1 and f"no running run named '{unique}'" in p.stderr, p.stderr
    p = dispatcher("status", "no-such-run")
    assert p.returncode == 1 and "no run named 'no-such-run'" in p.stderr


def test_the_console_script_answers_help():
    script = shutil.which("evalplane", path=str(Path(sys.executable).parent))
    assert script, "evalplane is not installed: scripts/bootstrap.sh (or uv pip install --no-deps -e .)"
    p = subprocess.run([script, "--help"], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for command in ("validate", "forecast", "images", "run", "resume", "cancel", "status", "dashboard", "report",
                    "judge"):
        assert command in p.stdout
    assert " plan " not in p.stdout  # the old name still works, but is not advertised
