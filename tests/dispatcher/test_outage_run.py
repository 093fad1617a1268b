"""A provider outage through a whole run (issue 35): `python -m dispatcher run` on the synthetic instances (process
launcher, mini-swe-agent, the provider simulator in its outage mode, an eval worker, the real PostgreSQL and Valkey,
moto). An outage shorter than the bound changes no status and ends no attempt, and the ledger shows the time held; a
longer one lands the attempts it holds as infra_error (provider_outage).

The outage lasts OUTAGE_S (the issue's 90 s), with the breaker's defaults (5 failures over 10 s, a probe every 5 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.e2e.test_local_run import without_gateway

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
OUTAGE_S = 90

pytestmark = pytest.mark.e2e


def run(tmp_path: Path, name: str, database_url, valkey_url, moto_endpoint, *, outage_s: float = 0,
        bound_s: float = 600, concurrency: int = 2, outage_after: int = 2) -> dict[str, tuple[str, str | None]]:
    text = without_gateway((ROOT / "examples" / "local.toml").read_text())
    text = text.replace('name = "local-demo"', f'name = "{name}"').replace('"synthetic/', f'"{SYNTHETIC}/')
    # a pool of its own: the breaker is the pool's, and other runs on the machine (other tests, other sessions) must
    # neither close it with their provider's answers nor find it open after this run's outage
    text = text.replace("[model]\n", f'[model]\npool = "{name}"\n', 1)
    text = text.replace("wall_time_s = 300", f"wall_time_s = 300\noutage_bound_s = {bound_s}")
    text = text.replace("concurrency = 2", f"concurrency = {concurrency}")
    text += "seed = 7\n"
    if outage_s:
        # after `outage_after` requests: inside the first attempts
        text += f"outage_after_calls = {outage_after}\noutage_s = {outage_s}\noutage_status = 529\n"
    d = tmp_path / name
    d.mkdir()
    (d / "spec.toml").write_text(text)
    env = {**os.environ, "DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "AWS_ENDPOINT_URL": moto_endpoint,
           "EVALPLANE_STATE_DIR": str(d / "state"), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_agent_register_timeout_ms": "120000"}
    p = subprocess.run([sys.executable, "-m", "dispatcher", "run", str(d / "spec.toml"), "--out", str(d / "out")],
                       check=False, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    with psycopg.connect(database_url) as conn:
        return {i: (s, e) for i, s, e in conn.execute(
            "SELECT instance_id, status, error FROM attempts WHERE run = %s", (name,)).fetchall()}


def held_ms(database_url, name: str) -> list[float]:
    with psycopg.connect(database_url) as conn:
        return [h for (h,) in conn.execute("SELECT held_ms FROM calls WHERE run = %s", (name,)).fetchall()]


def test_a_run_through_an_outage_ends_as_without_it_and_the_ledger_shows_the_hold(
        tmp_path, database_url, valkey_url, moto_endpoint, unique):
    calm = run(tmp_path, f"{unique}-calm", database_url, valkey_url, moto_endpoint)
    stormy = run(tmp_path, f"{unique}-out", database_url, valkey_url, moto_endpoint, outage_s=OUTAGE_S)
    assert {i: s for i, (s, _) in stormy.items()} == {i: s for i, (s, _) in calm.items()}
    assert "INFRA_ERROR" not in {s for s, _ in stormy.values()}  # no attempt ended by it
    held = held_ms(database_url, f"{unique}-out")
    assert max(held) > 10_000  # a call held through the outage, recorded as such
    assert held_ms(database_url, f"{unique}-calm") == [0.0] * len(held_ms(database_url, f"{unique}-calm"))


def test_an_outage_longer_than_the_bound_lands_the_attempts_as_provider_outage(
        tmp_path, database_url, valkey_url, moto_endpoint, unique):
    # from the first call: an attempt whose trajectory is two calls long would otherwise finish before the outage
    # when it made both of the first two (it did once, in a clean-clone CI on a loaded machine)
    got = run(tmp_path, unique, database_url, valkey_url, moto_endpoint, outage_s=3600, bound_s=8, concurrency=5,
              outage_after=0)
    assert len(got) == 5
    assert {s for s, _ in got.values()} == {"INFRA_ERROR"}
    assert all(e.startswith("provider_outage: ") for _, e in got.values()), got
