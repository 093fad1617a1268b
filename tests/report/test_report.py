"""`python -m dispatcher report RUN [--compare RUN_B]` over rows and a ledger written here: every cost and token
figure is the ledger's sum (to the last digit PostgreSQL keeps), pass@k is the estimator's, the PNGs and the HTML
are written, and a run compared with itself differs by zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from dispatcher.report.stats import pass_at_k
from tests.prices import priced

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

# instance -> statuses of attempts 1..3
STATUSES = {
    "repo__a-1": ["RESOLVED", "UNRESOLVED", "RESOLVED"],
    "repo__a-2": ["UNRESOLVED", "EMPTY_PATCH", "UNRESOLVED"],
    "repo__b-3": ["RESOLVED", "RESOLVED", "INFRA_ERROR"],  # the infrastructure failure is not scored
}


def make_run(conn: psycopg.Connection, run: str, statuses: dict[str, list[str]]) -> None:
    spec = {"model": {"model": "gpt-4o-mini", "pool": None}, "harness": {"name": "mini-swe-agent"},
            "budget": {"run_usd": 0.5}}
    conn.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts, status, created_at, finished_at)"
                 " VALUES (%s, %s, 'h', 'local', %s, 'finished', %s, %s)",
                 (run, Jsonb(spec), sum(map(len, statuses.values())), T0, T0 + timedelta(minutes=9)))
    k = 0
    for iid, sts in statuses.items():
        for n, status in enumerate(sts, start=1):
            k += 1
            start, end = T0 + timedelta(seconds=20 * k), T0 + timedelta(seconds=20 * k + 90)
            conn.execute(
                "INSERT INTO attempts (run, instance_id, attempt, harness, pool, model, outcome, status, wall_time_s,"
                " started_at, ended_at, eval_enqueued_at) VALUES (%s,%s,%s,'mini-swe-agent','p','gpt-4o-mini',"
                "'submitted',%s,90,%s,%s,%s)", (run, iid, n, status, start, end, end))
            if status in ("RESOLVED", "UNRESOLVED"):
                conn.execute("INSERT INTO phases (run, instance_id, attempt, phase, started_at, ended_at, outcome)"
                             " VALUES (%s,%s,%s,'eval',%s,%s,'x')",
                             (run, iid, n, end + timedelta(seconds=3), end + timedelta(seconds=13)))
            for seq in range(k % 3 + 1):  # 1-3 calls per attempt, odd amounts to the nano-dollar
                conn.execute(
                    "INSERT INTO calls (call_id, run, instance_id, attempt, seq, pool, provider, model, route, stream,"
                    " started_at, input_tokens, cached_tokens, cache_write_tokens, output_tokens, cost_usd,"
                    " latency_ms, pacer_wait_ms, retries, http_status, outcome, usage_estimated) VALUES"
                    " (%s,%s,%s,%s,%s,'p','openai','gpt-4o-mini','openai',false,%s,%s,%s,%s,%s,%s,%s,%s,%s,200,'ok',"
                    "false)",
                    (uuid.uuid4(), run, iid, n, seq, start + timedelta(seconds=5 * seq), 1000 + 17 * k + seq,
                     300 * seq, 7 * k, 50 + seq, Decimal(f"0.000{k:02d}{seq}123457"), 100.0 + 10 * seq + k,
                     float(5 * seq), seq % 2))
    conn.commit()


def report(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dispatcher", "report", *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT, check=False)


@pytest.fixture
def env(tmp_path, database_url):
    return os.environ | {"DATABASE_URL": database_url, "EVALPLANE_STATE_DIR": str(tmp_path / "state")}


def test_report_figures_are_the_ledgers_sums_and_its_files_are_written(pg, env, tmp_path, unique):
    make_run(pg, unique, STATUSES)
    p = report(env, unique, "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "out" / "report"
    summary = json.loads((out / "summary.json").read_text())
    (fig,) = summary["runs"]

    total, t_in, t_cached, t_write, t_out, n_calls, retries = pg.execute(
        "SELECT sum(cost_usd), sum(input_tokens), sum(cached_tokens), sum(cache_write_tokens), sum(output_tokens),"
        " count(*), sum(retries) FROM calls WHERE run = %s", (unique,)).fetchone()
    assert Decimal(fig["cost"]["total_usd"]) == total  # exact: numeric sums, decimal strings
    assert (fig["tokens"]["input_tokens"], fig["tokens"]["cached_tokens"], fig["tokens"]["cache_write_tokens"],
            fig["tokens"]["output_tokens"]) == (t_in, t_cached, t_write, t_out)
    assert fig["tokens"]["cache_hit_rate"] == pytest.approx(t_cached / (t_in + t_cached + t_write))
    assert fig["calls"]["calls"] == n_calls and fig["calls"]["retries"] == retries
    per_attempt = {(i, n): c for i, n, c in pg.execute(
        "SELECT instance_id, attempt, sum(cost_usd) FROM calls WHERE run = %s GROUP BY 1, 2", (unique,))}
    assert {(a["instance_id"], a["attempt"]): Decimal(a["cost_usd"]) for a in fig["attempts"]} == per_attempt
    assert Decimal(fig["cost"]["per_attempt_usd"]) == (total / 9).quantize(Decimal("1e-9"))
    assert Decimal(fig["cost"]["per_instance_usd"]) == (total / 3).quantize(Decimal("1e-9"))
    assert Decimal(fig["cost"]["per_resolved_instance_usd"]) == (total / 2).quantize(Decimal("1e-9"))
    p50 = pg.execute("SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ms) FROM calls WHERE run = %s",
                     (unique,)).fetchone()[0]
    assert fig["calls"]["latency_ms_p50"] == pytest.approx(p50)

    # pass@k: a-1 2 of 3, a-2 0 of 3, b-3 2 of 2 (its infrastructure failure is not scored)
    assert fig["statuses"] == {"RESOLVED": 4, "UNRESOLVED": 3, "EMPTY_PATCH": 1, "INFRA_ERROR": 1}
    assert fig["scored"] == 8
    pk = {p["k"]: p["estimate"] for p in fig["pass_at"]}
    assert pk[1]["value"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert pk[2]["value"] == pytest.approx((pass_at_k(3, 2, 2) + 0 + 1) / 3) == pytest.approx((1 + 0 + 1) / 3)
    assert pk[3]["value"] == pytest.approx((1 + 0) / 2) and pk[3]["n"] == 2
    assert pk[1]["lo"] <= pk[1]["value"] <= pk[1]["hi"]

    for name in ("resolved_vs_cost.png", "spend_over_time.png", "concurrency_over_time.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3  # self-contained: the plots are inside
    assert 'src="http' not in html and "<link" not in html
    assert f"${total:.6f}" in html and "pass@3" in html
    assert f"${total:.6f}" in p.stdout  # the terminal summary


def test_a_run_compared_with_itself_has_a_zero_difference(pg, env, tmp_path, unique):
    make_run(pg, unique, STATUSES)
    p = report(env, unique, "--compare", unique, "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "out" / "report"
    cmp = json.loads((out / "summary.json").read_text())["compare"]
    assert cmp["instances"] == 3
    assert cmp["difference"]["value"] == cmp["difference"]["lo"] == cmp["difference"]["hi"] == 0.0
    assert cmp["mcnemar"]["a_only"] == cmp["mcnemar"]["b_only"] == 0 and cmp["mcnemar"]["p_value"] == 1.0
    assert (out / "instance_grid.png").stat().st_size > 5000
    assert "+0.0 pp" in (out / "report.html").read_text()


def test_two_runs_compared_on_their_shared_instances(pg, env, tmp_path, unique):
    other = unique + "-b"
    make_run(pg, unique, STATUSES)
    make_run(pg, other, {"repo__a-1": ["UNRESOLVED"], "repo__a-2": ["UNRESOLVED"], "repo__b-3": ["UNRESOLVED"],
                         "repo__c-4": ["RESOLVED"]})
    p = report(env, unique, "--compare", other, "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    cmp = json.loads((tmp_path / "out" / "report" / "summary.json").read_text())["compare"]
    assert cmp["instances"] == 3  # repo__c-4 is only in the second run
    assert cmp["difference"]["value"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert (cmp["mcnemar"]["a_only"], cmp["mcnemar"]["b_only"]) == (2, 0)  # first attempts: a-1 and b-3


def test_unknown_runs_and_bad_names_are_refused_and_nothing_is_written(pg, env, tmp_path, unique):
    make_run(pg, unique, STATUSES)
    p = report(env, "no-such-run", "--out", str(tmp_path / "out"))
    assert p.returncode == 1 and "no run named 'no-such-run'" in p.stderr
    p = report(env, unique, "--compare", "nope", "--out", str(tmp_path / "out"))
    assert p.returncode == 1 and "no run named 'nope'" in p.stderr
    p = report(env, "Not A Run!", "--out", str(tmp_path / "out"))
    assert p.returncode == 2 and "neither a spec file nor a run name" in p.stderr
    assert not (tmp_path / "out").exists()


def record_compute(conn: psycopg.Connection, run: str, task_cpu: float) -> None:
    """Each attempt's task resources, its container's figures and its grading's, as the writer lands them."""
    conn.execute("UPDATE runs SET spec = jsonb_set(spec, '{backend}', %s) WHERE run = %s",
                 (Jsonb({"task_cpu": task_cpu}), run))
    conn.execute(
        """UPDATE attempts SET task_cpu = %s, task_memory_mib = 2048, task_memory_limit_mib = 4096,
                  task_cpu_s = 30 + attempt, task_memory_peak_bytes = (500 + attempt) * 1048576,
                  task_wall_s = 80 + 7 * attempt + length(instance_id), usage_source = 'cgroup',
                  task_capacity = CASE WHEN attempt = 2 THEN 'spot' END,
                  grading_wall_s = CASE WHEN status IN ('RESOLVED', 'UNRESOLVED') THEN 10 + attempt END,
                  grading_cpu_s = CASE WHEN status IN ('RESOLVED', 'UNRESOLVED') THEN 4 END
           WHERE run = %s""", (task_cpu, run))
    conn.commit()


def test_compute_cost_is_the_recorded_figures_times_the_price_table_beside_the_token_cost(pg, env, tmp_path,
                                                                                        unique):
    make_run(pg, unique, STATUSES)
    record_compute(pg, unique, 1.0)
    p = report(env, unique, "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    (fig,) = json.loads((tmp_path / "out" / "report" / "summary.json").read_text())["runs"]
    cur = pg.execute("SELECT instance_id, attempt, task_cpu, task_memory_limit_mib, task_wall_s, task_capacity,"
                     " grading_wall_s FROM attempts WHERE run = %s", (unique,))
    rows = [dict(zip([d.name for d in cur.description], r)) for r in cur.fetchall()]
    want = {(r["instance_id"], r["attempt"]): priced(r) for r in rows}
    spot = [r for r in rows if r["task_capacity"] == "spot"]  # priced at Spot's rates, the rest at on-demand
    assert spot and all(priced(r) < priced(r | {"task_capacity": "on_demand"}) for r in spot)
    got = {(a["instance_id"], a["attempt"]): Decimal(a["compute_usd"]) for a in fig["attempts"]}
    assert got == want and all(v > 0 for v in got.values())
    compute = sum(want.values())
    tokens = Decimal(fig["cost"]["total_usd"])
    assert Decimal(fig["cost"]["compute"]["total_usd"]) == compute
    assert Decimal(fig["cost"]["combined"]["total_usd"]) == tokens + compute
    assert Decimal(fig["cost"]["compute"]["per_attempt_usd"]) == (compute / 9).quantize(Decimal("1e-9"))
    assert Decimal(fig["cost"]["combined"]["per_resolved_instance_usd"]) == ((tokens + compute) / 2).quantize(
        Decimal("1e-9"))
    a = fig["attempts"][0]
    assert (a["task_cpu_s"], a["task_memory_peak_bytes"]) == (31.0, 501 * 2**20)
    assert fig["resources"] == ["1 vCPU, 2048 MiB (limit 4096 MiB)"]
    assert "compute cost (tasks, grading)" in p.stdout and f"${compute:.6f}" in p.stdout
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert f"${compute:.6f}" in html and f"{want[('repo__a-1', 1)]:.6f}" in html  # the total and one attempt's


def test_two_runs_that_differ_only_in_task_cpu_are_compared_with_their_resources_shown(pg, env, tmp_path, unique):
    other = unique + "-cpu2"
    for run, cpu in ((unique, 1.0), (other, 2.0)):
        make_run(pg, run, STATUSES)
        record_compute(pg, run, cpu)
    p = report(env, unique, "--compare", other, "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "out" / "report" / "summary.json").read_text())
    a, b = summary["runs"]
    assert (a["resources"], b["resources"]) == (["1 vCPU, 2048 MiB (limit 4096 MiB)"],
                                                ["2 vCPU, 2048 MiB (limit 4096 MiB)"])
    assert Decimal(b["cost"]["compute"]["total_usd"]) > Decimal(a["cost"]["compute"]["total_usd"])
    assert summary["compare"]["instances"] == 3
    line = next(x for x in p.stdout.splitlines() if "task resources" in x)
    assert "1 vCPU, 2048 MiB" in line and "2 vCPU, 2048 MiB" in line  # side by side, one row
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "1 vCPU, 2048 MiB" in html and "2 vCPU, 2048 MiB" in html
