"""The demo run prices its compute: every attempt records its task's resources, what its task used and its
grading's time; the results table and the report show compute seconds and compute cost per attempt beside the
token cost, each equal to the recorded figures times the price table; `forecast` prints the predicted compute
cost, and the forecast `run` keeps is printed against what the run took."""

from __future__ import annotations

import json
from decimal import Decimal

import psycopg
import pytest
from test_local_run import demo_expectation, dispatcher, write_spec

from tests.prices import priced

pytestmark = pytest.mark.e2e


def table_rows(stdout: str, first: set[str] | None = None) -> dict[str, list[str]]:
    """A printed table's rows whose first cell is in `first` (default: the results table's attempt rows, by
    instance): their cells, as printed."""
    first = set(demo_expectation()) if first is None else first
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] in first:
            rows[cells[0]] = cells
    return rows


def header(stdout: str) -> list[str]:
    line = next(x for x in stdout.splitlines() if "tokens $" in x and "compute $" in x)
    return [c.strip() for c in line.split("┃")[1:-1]]


def test_the_demo_prices_compute_per_attempt_beside_tokens(tmp_path, env, database_url, unique):
    spec = write_spec(tmp_path, unique)
    f = dispatcher(env, "forecast", str(spec))
    assert f.returncode == 0, f.stderr[-3000:]
    predicted = next(x for x in f.stdout.splitlines() if x.startswith("predicted compute cost: $"))
    assert float(predicted.split("$")[1].split()[0]) > 0

    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-4000:]
    with psycopg.connect(database_url) as conn:
        cur = conn.execute("SELECT * FROM attempts WHERE run = %s", (unique,))
        rows = {r["instance_id"]: r for r in (dict(zip([d.name for d in cur.description], v)) for v in cur)}
    assert {i: r["status"] for i, r in rows.items()} == demo_expectation()
    for iid, r in rows.items():
        assert (r["task_cpu"], r["task_memory_mib"], r["task_memory_limit_mib"]) == (1.0, 4096, 4096), iid
        assert r["usage_source"] == "rusage" and r["task_cpu_s"] > 0 and r["task_memory_peak_bytes"] > 0, iid
        assert r["task_wall_s"] > 0, iid
        graded = r["status"] in ("RESOLVED", "UNRESOLVED")
        assert (r["grading_wall_s"] is not None and r["grading_wall_s"] > 0) == graded, iid
        assert (r["grading_cpu_s"] is not None and r["grading_cpu_s"] > 0) == graded, iid  # the process grader

    cols = header(p.stdout)
    printed = table_rows(p.stdout)
    assert set(printed) == set(rows)
    for iid, cells in printed.items():
        cell = dict(zip(cols, cells))
        r = rows[iid]
        assert cell["tokens $"] == f"{r['cost_usd']:.6f}"
        assert cell["compute $"] == f"{priced(r):.6f}", iid
        assert cell["total $"] == f"{Decimal(str(r['cost_usd'])) + priced(r):.6f}", iid
        assert cell["task wall/cpu s"] == f"{r['task_wall_s']:.1f}/{r['task_cpu_s']:.1f}", iid
        assert cell["peak MiB"] == f"{r['task_memory_peak_bytes'] / 2**20:.0f}", iid

    rep = dispatcher(env, "report", unique, "--out", str(tmp_path / "report"))
    assert rep.returncode == 0, rep.stderr[-3000:]
    (fig,) = json.loads((tmp_path / "report" / "report" / "summary.json").read_text())["runs"]
    assert {a["instance_id"]: Decimal(a["compute_usd"]) for a in fig["attempts"]} == {
        i: priced(r) for i, r in rows.items()}
    assert {a["instance_id"]: a["task_cpu_s"] for a in fig["attempts"]} == {i: r["task_cpu_s"] for i, r in rows.items()}
    assert fig["resources"] == ["1 vCPU, 4096 MiB"]
    assert "compute cost (tasks, grading)" in rep.stdout and "per attempt: tokens / compute / total" in rep.stdout

    # the forecast `run` made before it launched anything, against what the run took: at its end and in `report`
    with psycopg.connect(database_url) as conn:
        kept, made_at, created, finished = conn.execute(
            "SELECT f.forecast, f.made_at, r.created_at, r.finished_at FROM run_forecasts f JOIN runs r USING (run)"
            " WHERE run = %s", (unique,)).fetchone()
    assert made_at < created and kept["attempts"] == len(rows)
    tokens = sum(Decimal(str(r["cost_usd"])) for r in rows.values())
    compute = sum(priced(r) for r in rows.values())
    want = {"wall time": [f"{kept['wall_time_s'] / 60:.1f} min", f"{(finished - made_at).total_seconds() / 60:.1f} min"],
            "token cost": [f"${kept['token_usd']:.4f}", f"${tokens:.4f}"],
            "compute cost": [f"${kept['compute']['task_usd'] + kept['compute']['grading_usd']:.4f}", f"${compute:.4f}"]}
    for out in (p.stdout, rep.stdout):
        assert "predicted against actual" in out, out[-3000:]
        printed = {label: cells[1:3] for label, cells in table_rows(out, set(want)).items()}
        assert printed == want, (printed, want)
