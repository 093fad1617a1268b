"""A process-launcher run through the gateway tier: the demo spec with [gateway]. Every call has a shim row and a
gateway row that agree (tokens by kind, cost), the provider's usage of the run's own key agrees in total, the task
logs hold no provider key, the report reconciles the three meters with no difference, and once the run has ended its
gateway key is refused and its provider key revoked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from contract import signing
from dispatcher.report.reconcile import reconcile
from gateway import keyfile, tier
from plumbing.services import recorded_pid
from tests.e2e.test_local_run import ROOT, demo_expectation, dispatcher, write_spec

pytestmark = pytest.mark.e2e
TOKENS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")


@pytest.fixture
def env(tmp_path, database_url, valkey_url, moto_endpoint):
    state = tmp_path / "state"
    yield {**os.environ, "DATABASE_URL": database_url, "VALKEY_URL": valkey_url,
           "AWS_ENDPOINT_URL": moto_endpoint, "EVALPLANE_STATE_DIR": str(state), "RAY_USAGE_STATS_ENABLED": "0"}
    tier.stop(state)


def gateway_spec(tmp_path: Path, run: str, concurrency: int = 2) -> Path:
    """The demo spec as it is: examples/local.toml has its [gateway] table (two replicas)."""
    return write_spec(tmp_path, run, concurrency)


def test_demo_run_through_the_gateway(tmp_path, env, database_url, unique):
    spec = gateway_spec(tmp_path, unique)
    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"), timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    with psycopg.connect(database_url) as conn:
        status = dict(conn.execute("SELECT instance_id, status FROM attempts WHERE run = %s", (unique,)).fetchall())
        cols = ", ".join(f"c.{t}, g.{t}" for t in TOKENS)
        pairs = conn.execute(
            f"SELECT c.call_id, c.gateway_call_id, g.gateway_call_id, c.cost_usd, g.cost_usd, {cols}"
            " FROM calls c LEFT JOIN gateway_calls g USING (gateway_call_id) WHERE c.run = %s", (unique,)).fetchall()
        gateway_ok = conn.execute("SELECT count(*) FROM gateway_calls WHERE owner = %s AND status = 'ok'",
                                  (unique,)).fetchone()[0]
        provider_key = conn.execute("SELECT provider, usage, revoked_at FROM provider_keys WHERE owner = %s",
                                    (unique,)).fetchone()
    assert status == demo_expectation()
    assert pairs and all(r[1] is not None and r[1] == r[2] for r in pairs), pairs  # every shim row has its gateway row
    assert gateway_ok == len(pairs)  # and the gateway served no call the shims did not record
    for r in pairs:
        assert float(r[3]) == pytest.approx(float(r[4]), rel=1e-6, abs=1e-9), r
        assert r[5::2] == r[6::2], r
    # the run's cap was its own provider key's limit: revoked at its end, its usage that of the gateway's calls
    assert provider_key[0] == "simulator" and provider_key[2] is not None and provider_key[1]["calls"] == gateway_ok

    state = Path(env["EVALPLANE_STATE_DIR"])
    provider_keys = list(keyfile.read(tier.provider_keys_file(state)).values())
    assert provider_keys
    for f in (state / "runs" / unique / "tasks").rglob("*"):  # what the tasks wrote: no provider key in it
        if f.is_file():
            assert not any(k in f.read_text(errors="replace") for k in provider_keys), f

    report = dispatcher(env, "report", unique)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "gateway" in report.stdout and "calls that differ: 0" in report.stdout, report.stdout
    [official] = (tmp_path / "out").glob("*.json")  # the official report: its meters agree (an extra key)
    assert json.loads(official.read_text())["meters"]["agree"] is True
    assert "meters (shim, gateway and provider) agree" in p.stdout, p.stdout[-3000:]

    info = tier.running(state)
    run_key = signing.gateway_key((state / "runs" / unique / "run.key").read_bytes().strip())
    r = httpx.post(f"{info.url}/v1/chat/completions", headers={"Authorization": f"Bearer {run_key}"}, timeout=30,
                   json={"model": f"gpt-4o-mini@mini-swe-agent/{unique}", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401, r.text  # revoked at the run's end


def test_a_replica_killed_mid_run_loses_no_call(tmp_path, env, database_url, unique):
    """SIGKILL one replica once the run's calls flow: every attempt lands as it would have, and the shim ledger and
    the gateway rows still agree call by call (the shims retried the calls it cut; its rows in transit were
    drained by the other replica)."""
    spec = gateway_spec(tmp_path, unique, concurrency=4)
    state = Path(env["EVALPLANE_STATE_DIR"])
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "run", str(spec), "--out", str(tmp_path / "out")],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        with psycopg.connect(database_url, autocommit=True) as conn:
            while conn.execute("SELECT count(*) FROM gateway_calls WHERE owner = %s", (unique,)).fetchone()[0] < 3:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()[-3000:]
                time.sleep(0.1)
        os.kill(recorded_pid(state / "gateway" / "replica-0.pid"), signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    with psycopg.connect(database_url) as conn:
        status = dict(conn.execute("SELECT instance_id, status FROM attempts WHERE run = %s", (unique,)).fetchall())
        meters = reconcile(conn, unique)
        after_kill = conn.execute("SELECT count(*) FROM gateway_calls WHERE owner = %s AND replica = 'replica-1'",
                                  (unique,)).fetchone()[0]
        retried = conn.execute("SELECT coalesce(sum(retries), 0) FROM calls WHERE run = %s", (unique,)).fetchone()[0]
        differing = [d for d in meters.differences if d.shim_call_id or d.gateway_call_id]
        why = [(d.what, conn.execute("SELECT replica, status, route, latency_ms, output_tokens FROM gateway_calls WHERE"
                                     " gateway_call_id = %s", (d.gateway_call_id,)).fetchone(),
                conn.execute("SELECT outcome, http_status, retries, usage_estimated, stream, latency_ms FROM calls"
                             " WHERE call_id::text = %s", (d.shim_call_id or "",)).fetchone()) for d in differing]
    assert status == demo_expectation()
    assert differing == [], why
    assert meters.shim.calls == meters.gateway.calls > 3 and after_kill > 0
    assert meters.shim.model_dump() == pytest.approx(meters.gateway.model_dump())
    # A call the killed replica was serving reached the provider, which counts it, but neither the replica (killed
    # before its row) nor the shim (which retried it through the other) has it: the report shows that difference.
    extra = meters.provider.calls - meters.gateway.calls
    assert 0 <= extra <= retried, (extra, retried)
    assert (extra > 0) == bool(meters.differences), meters.differences
