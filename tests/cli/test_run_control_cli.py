"""pause, resume, resize, status and retry from the command line, on a run's stored state (no driver here: what
the driver does with that state is tests/dispatcher/test_run_control.py's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from contract import keys
from dispatcher import store
from dispatcher.driver import loop as runmod
from dispatcher.plan import make_plan
from dispatcher.spec import load_spec
from tests.cli.test_run_or_spec import ROOT, local_spec


def test_pause_resize_resume_and_retry_act_on_the_runs_stored_state(pg, database_url, tmp_path: Path, unique):
    runmod.open_run(pg, make_plan(load_spec(local_spec(tmp_path, unique))))
    for iid, status, error in (("evalplane__calc-1", "RESOLVED", None),
                               ("evalplane__calc-2", "INFRA_ERROR", "rate_limited: the upstream refused calls"),
                               ("evalplane__textkit-1", "INFRA_ERROR", "task_died: exited with code -9")):
        pg.execute("INSERT INTO attempts (run, instance_id, attempt, harness, pool, model, outcome, status, error)"
                   " VALUES (%s, %s, 1, 'mini-swe-agent', 'p', 'm', 'submitted', %s, %s)", (unique, iid, status, error))
    pg.commit()
    env = {"DATABASE_URL": database_url, "PATH": "/usr/bin:/bin", "EVALPLANE_STATE_DIR": str(tmp_path / "state")}

    def dispatcher(*args):
        return subprocess.run([sys.executable, "-m", "dispatcher", *args], check=False, env=env, capture_output=True,
                              text=True, cwd=ROOT, timeout=60)

    assert dispatcher("pause", unique).returncode == 0
    assert dispatcher("resize", unique, "3").returncode == 0
    p = dispatcher("status", unique)
    assert p.stdout.startswith(f"{unique}: paused, at most 3 at once, 3/5 attempts landed"), p.stdout + p.stderr
    assert dispatcher("resize", unique, "0").returncode == 2  # at least one
    p = dispatcher("resume", unique)  # the pause is lifted, nothing is driven
    assert p.returncode == 0 and "resumed" in p.stdout, p.stderr
    assert dispatcher("status", unique).stdout.startswith(f"{unique}: running, at most 3 at once")
    p = dispatcher("resume", unique)  # not paused, and no spec to drive it from
    assert p.returncode == 2 and "resume SPEC" in p.stderr

    p = dispatcher("retry", unique, "--status", "rate_limited")
    assert p.returncode == 0, p.stderr
    assert "evalplane__calc-2 attempt 1 (rate_limited): relaunched as attempt 2" in p.stdout
    assert "textkit-1" not in p.stdout  # task_died was not named
    p = dispatcher("retry", unique)  # every infra_error left: the one not retried yet
    assert "evalplane__textkit-1 attempt 1 (task_died): relaunched as attempt 2" in p.stdout and "calc-2" not in p.stdout
    assert pg.execute("SELECT instance_id, attempt, slot, replaces FROM retries WHERE run = %s ORDER BY 1",
                      (unique,)).fetchall() == [("evalplane__calc-2", 2, 1, 1), ("evalplane__textkit-1", 2, 1, 1)]
    assert dispatcher("status", unique).stdout.startswith(f"{unique}: running, at most 3 at once, 3/7 attempts")


def test_pause_hold_calls_stores_the_hold_and_sets_it_for_the_shims_and_resume_lifts_both(
        pg, database_url, valkey, valkey_url, tmp_path: Path, unique):
    runmod.open_run(pg, make_plan(load_spec(local_spec(tmp_path, unique))))
    pg.commit()
    env = {"DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "PATH": "/usr/bin:/bin",
           "EVALPLANE_STATE_DIR": str(tmp_path / "state")}

    def dispatcher(*args):
        return subprocess.run([sys.executable, "-m", "dispatcher", *args], check=False, env=env, capture_output=True,
                              text=True, cwd=ROOT, timeout=60)

    def stored() -> tuple[bool, bool]:
        c = store.control(pg, unique)
        pg.commit()
        return c.paused, c.hold_calls

    try:
        p = dispatcher("pause", unique, "--hold-calls")
        assert p.returncode == 0 and "calls held" in p.stdout, p.stdout + p.stderr
        assert stored() == (True, True) and valkey.exists(keys.run_hold(unique))
        assert dispatcher("status", unique).stdout.startswith(f"{unique}: paused (calls held), 0/5 attempts landed")
        assert dispatcher("pause", unique).returncode == 0  # a pause again keeps the hold: only resume lifts it
        assert stored() == (True, True) and valkey.exists(keys.run_hold(unique))
        p = dispatcher("resume", unique)
        assert p.returncode == 0 and "held calls go on" in p.stdout, p.stdout + p.stderr
        assert stored() == (False, False) and not valkey.exists(keys.run_hold(unique))
        assert dispatcher("status", unique).stdout.startswith(f"{unique}: running, 0/5 attempts landed")

        assert dispatcher("pause", unique).returncode == 0  # without the flag: no hold
        assert stored() == (True, False) and not valkey.exists(keys.run_hold(unique))
        assert dispatcher("status", unique).stdout.startswith(f"{unique}: paused, 0/5")

        valkey.delete(keys.run_hold(unique))
        assert dispatcher("pause", "no-such-run-" + unique, "--hold-calls").returncode == 1
        assert not valkey.exists(keys.run_hold("no-such-run-" + unique))
    finally:
        valkey.delete(keys.run_hold(unique))
