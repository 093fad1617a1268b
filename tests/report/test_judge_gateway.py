"""The judge through the gateway tier (`judge RUN --gateway`, the default for a local run whose spec has [gateway]):
its calls go shim → gateway → the judge's simulator under a gateway key of the judge's own (owner <run>.judge,
budget --budget-usd), every call has a gateway row its ledger row names, the key is refused once the pass has ended,
and the judge's budget holds through the gateway."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from decimal import Decimal

import httpx
import pytest
import redis
from psycopg.types.json import Jsonb

from contract import keys as vkeys
from gateway import keys
from simulator import SimulatorConfig
from simulator.testing import running_simulator
from tests.report.test_judge import CASES, ROOT, judge, make_run, stop_simulator, verdicts

WITH_TRAJECTORY = {iid for iid, case in CASES.items() if case[0] is not None}


@pytest.fixture
def env(gateway_tier, database_url, valkey_url, moto_endpoint):
    """The command's environment: its state folder is the session tier's, so `judge` finds that tier running."""
    import os

    state, _ = gateway_tier
    return os.environ | {"DATABASE_URL": database_url, "VALKEY_URL": valkey_url, "AWS_ENDPOINT_URL": moto_endpoint,
                         "EVALPLANE_STATE_DIR": str(state)}


def ledger(pg, run: str) -> list[tuple]:
    rows = pg.execute("SELECT instance_id, outcome, cost_usd, gateway_call_id, pool FROM calls WHERE run = %s",
                      (run + ".judge",)).fetchall()
    pg.commit()
    return rows


def gateway_rows(pg, run: str) -> dict[str, tuple]:
    rows = pg.execute("SELECT gateway_call_id, alias, status, cost_usd FROM gateway_calls WHERE owner = %s",
                      (run + ".judge",)).fetchall()
    pg.commit()
    return {r[0]: r[1:] for r in rows}


def assert_key_revoked(pg, valkey, run: str) -> None:
    """The judge's key: marked revoked in PostgreSQL and gone from Valkey, where the replicas look first."""
    rows = pg.execute("SELECT key_hash, revoked_at, budget_usd FROM gateway_keys WHERE owner = %s",
                      (run + ".judge",)).fetchall()
    pg.commit()
    assert len(rows) == 1 and rows[0][1] is not None, rows
    assert valkey.get(vkeys.gateway_key(rows[0][0])) is None
    assert keys.from_database(pg, rows[0][0]) is None


def test_a_run_with_a_gateway_is_judged_through_it_under_the_judges_own_key(pg, valkey, env, unique):
    make_run(pg, unique)
    pg.execute("UPDATE runs SET spec = %s WHERE run = %s", (Jsonb({"gateway": {"replicas": 2}}), unique))
    pg.commit()
    try:
        p = judge(env, unique, "--budget-usd", "0.05")  # no flag: the stored spec's [gateway] turns it on
    finally:
        stop_simulator(env, unique)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "through the gateway, key revoked" in p.stdout

    got = verdicts(pg, unique)
    for iid, (_, _, status, answers) in CASES.items():
        assert got[iid][0] == status, iid
        if answers is not None:  # the judge policy read the trajectory through LiteLLM's translation unchanged
            assert {q: a["answer"] for q, a in got[iid][1].items()} == answers, iid

    calls = ledger(pg, unique)
    rows = gateway_rows(pg, unique)
    assert sorted(c[0] for c in calls) == sorted(WITH_TRAJECTORY)  # one call per trajectory
    assert all(c[1] == "ok" and c[4] == "gpt-4o-mini@judge" for c in calls), calls
    # every judge call has its gateway row, and nothing else went through the judge's key
    assert {c[3] for c in calls} == set(rows) and None not in set(rows)
    for instance, _, cost, call_id, _ in calls:
        alias, status, gw_cost = rows[call_id]
        assert alias.startswith(f"gpt-4o-mini@judge/{unique}.judge/") and status == "ok", instance
        assert abs(gw_cost - cost) < Decimal("0.000001"), (instance, gw_cost, cost)  # the two meters agree
    assert pg.execute("SELECT count(*) FROM gateway_calls WHERE owner = %s", (unique,)).fetchone()[0] == 0
    assert_key_revoked(pg, valkey, unique)


def test_the_judges_budget_holds_through_the_gateway_and_a_rerun_finishes(pg, valkey, env, unique):
    make_run(pg, unique)  # its spec has no [gateway]: --gateway asks for it
    budget = Decimal("0.0009")  # a few calls' worth (tests/report/test_judge.py)
    try:
        p = judge(env, unique, "--gateway", "--budget-usd", str(budget))
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"the judge's budget (${budget}) is spent" in p.stderr
        first = gateway_rows(pg, unique)
        spent = sum((r[2] for r in first.values()), Decimal(0))
        assert first and spent <= budget + max(r[2] for r in first.values())  # at most one call past the budget
        left = set(CASES) - set(verdicts(pg, unique))
        assert left, "the budget should have left trajectories for a rerun"
        assert_key_revoked(pg, valkey, unique)

        p = judge(env, unique, "--gateway", "--budget-usd", "0.05")  # raised: the rerun mints a new key
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    finally:
        stop_simulator(env, unique)
    assert set(verdicts(pg, unique)) == set(CASES)
    answered = sorted(c[0] for c in ledger(pg, unique) if c[1] == "ok")
    assert answered == sorted(WITH_TRAJECTORY)  # each asked once across both passes
    assert {c[3] for c in ledger(pg, unique) if c[1] == "ok"} <= set(gateway_rows(pg, unique))
    assert_key_revoked(pg, valkey, unique)


def test_the_judges_key_serves_its_alias_within_its_budget_and_not_after_the_pass(gateway_tier, database_url,
                                                                                valkey_url, monkeypatch, unique):
    """open_judge/close_judge without the shim: the gateway itself refuses the judge's key past its budget (403) and
    once revoked (401)."""
    from dispatcher.judge.gateway import close_judge, open_judge

    state, info = gateway_tier
    monkeypatch.setenv("EVALPLANE_STATE_DIR", str(state))
    monkeypatch.setenv("DATABASE_URL", database_url)
    owner = f"{unique}.judge"
    with running_simulator(SimulatorConfig(api_key="sk-sim-judge-" + unique)) as sim:
        gw = open_judge(database_url, valkey_url, owner, "gpt-4o-mini@judge", "openai", "gpt-4o-mini", sim,
                        "sk-sim-judge-" + unique, budget_usd=0.000001)
        assert gw.url == info.url and gw.alias.startswith(f"gpt-4o-mini@judge/{owner}/")
        assert "sk-sim" not in gw.key  # the shims get the gateway key, never the provider's

        def call(key: str, model: str = gw.alias) -> httpx.Response:
            return httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              timeout=60, json={"model": model, "max_tokens": 16,
                                                "messages": [{"role": "user", "content": "Judge this."}]})

        first = call(gw.key)
        assert first.status_code == 200, first.text
        assert call(gw.key, "gpt-4o-mini").status_code != 200  # scoped to its own alias
        over = call(gw.key)  # the first call's cost is past the one-micro-dollar budget
        assert over.status_code == 403 and "budget" in over.text, over.text
        assert close_judge(database_url, valkey_url, owner)
        after = call(gw.key)
        assert after.status_code == 401, after.text
    r = redis.Redis.from_url(valkey_url)
    assert int(r.get(vkeys.gateway_spend(owner)) or 0) > 0  # the meter charged the judge's owner


def test_a_judge_pass_stopped_half_way_revokes_its_key(pg, valkey, env, unique):
    """SIGTERM (as Ctrl-C) mid-pass: the attempts not yet asked are left for a rerun, the key is refused at once."""
    make_run(pg, unique)
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "judge", unique, "--gateway", "--concurrency", "1",
                             "--budget-usd", "0.05"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(verdicts(pg, unique)) < 2 and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the judge finished before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_simulator(env, unique)
    assert proc.returncode != 0, stderr[-3000:]
    assert 2 <= len(verdicts(pg, unique)) < len(CASES)  # stopped: not every trajectory was asked
    assert_key_revoked(pg, valkey, unique)
