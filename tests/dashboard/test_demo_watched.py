"""The demo run (examples/local.toml: synthetic instances, mini-swe-agent, the gateway tier, the simulator, the
process launcher), watched live in headless Chromium through `python -m dispatcher dashboard`; the numbers the page
showed at the end are checked against PostgreSQL. Then the run's report and the judge over its real trajectories.
The screenshots in the README (docs/images/) are made here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
IMAGES = ROOT / "docs" / "images"
pytestmark = pytest.mark.e2e

SNAPSHOT_JS = """
const t = (id) => document.getElementById(id) ? document.getElementById(id).textContent : null;
const statuses = {};
for (const el of document.querySelectorAll('.status')) {
  statuses[el.id.replace('status-', '')] = Number(el.querySelector('.count').textContent);
}
return {state: t('state'), final: t('final'), planned: t('planned'), running: t('running'), target: t('target'),
        spent: t('spent'), cap: t('cap'), calls: t('calls'), in_flight: t('in-flight'), updates: t('updates'),
        source: t('spend-source'), admitted: t('pool-admitted'), limits: t('pool-limits'), statuses: statuses,
        rows: document.querySelectorAll('#attempts tr').length, visible: !document.getElementById('view').hidden};
"""


def demo_spec(tmp: Path, run: str) -> Path:
    text = (ROOT / "examples" / "local.toml").read_text()
    text = text.replace('name = "local-demo"', f'name = "{run}"').replace('"synthetic/', f'"{SYNTHETIC}/')
    spec = tmp / "spec.toml"
    spec.write_text(text)
    return spec


def expected_statuses() -> dict[str, int]:
    policy = json.loads((SYNTHETIC / "demo_policy.json").read_text())["instances"]
    rows = [json.loads(x) for x in (SYNTHETIC / "instances.jsonl").read_text().splitlines() if x.strip()]
    out: dict[str, int] = {}
    for r in rows:
        s = {"gold": "RESOLVED", "patch": "UNRESOLVED", "empty": "EMPTY_PATCH"}[
            policy.get(r["instance_id"], {}).get("action", "gold")]
        out[s] = out.get(s, 0) + 1
    return out


def shoot(browser, path: Path, height: int | None = None) -> None:
    if height:
        browser.set_window_size(1300, height)
    path.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(path)), path


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory, database_url, valkey_url, moto_endpoint):
    """The demo's environment; the gateway tier its run started (the spec's [gateway]) is stopped after the module."""
    from gateway import tier

    tmp = tmp_path_factory.mktemp("demo")
    yield tmp, os.environ | {"DATABASE_URL": database_url, "VALKEY_URL": valkey_url,
                             "AWS_ENDPOINT_URL": moto_endpoint, "EVALPLANE_STATE_DIR": str(tmp / "state"),
                             "RAY_USAGE_STATS_ENABLED": "0"}
    tier.stop(tmp / "state")


@pytest.fixture(scope="module")
def watched(demo_env, browser):
    """Serve the dashboard, run the demo, and record what the page shows about twice a second until the end."""
    tmp, env = demo_env
    run = f"watched-{os.getpid()}-{int(time.time()) % 100000}"
    port_file = tmp / "dashboard.url"
    with contextlib.ExitStack() as logs:
        log = lambda name: logs.enter_context(open(tmp / name, "wb"))
        dash = subprocess.Popen([sys.executable, "-m", "dispatcher", "dashboard", "--port", "0", "--port-file",
                                 str(port_file)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=log("dashboard.log"), start_new_session=True)
        proc = None
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                assert dash.poll() is None and time.monotonic() < deadline, (tmp / "dashboard.log").read_text()
                time.sleep(0.1)
            url = port_file.read_text().strip()
            browser.get(f"{url}?run={run}")
            browser.execute_script("window.__sameDocument = 42")  # gone if the page ever reloads
            proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "run", str(demo_spec(tmp, run)), "--out",
                                     str(tmp / "out")], env=env, cwd=ROOT, stdout=log("run.out"),
                                    stderr=log("run.err"), start_new_session=True)
            seen, shot = [], False
            deadline = time.monotonic() + 900
            while proc.poll() is None and time.monotonic() < deadline:
                snap = browser.execute_script(SNAPSHOT_JS)
                seen.append(snap)
                if not shot and snap["visible"] and snap["running"] not in (None, "0") and int(snap["final"]) >= 2:
                    shoot(browser, IMAGES / "dashboard.png")  # mid-run: tasks running, spend moving
                    shot = True
                time.sleep(0.5)
            assert proc.returncode == 0, (tmp / "run.err").read_text()[-4000:]
            deadline = time.monotonic() + 30
            while (end := browser.execute_script(SNAPSHOT_JS))["state"] != "finished" and time.monotonic() < deadline:
                time.sleep(0.3)
            if not shot:
                shoot(browser, IMAGES / "dashboard.png")
            yield {"run": run, "seen": seen, "end": end, "env": env, "tmp": tmp,
                   "same_document": browser.execute_script("return window.__sameDocument")}
        finally:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(dash.pid, signal.SIGTERM)
            dash.wait(timeout=30)


def test_the_dashboard_follows_the_run_and_ends_with_postgres_numbers(watched, database_url):
    seen, end, run = watched["seen"], watched["end"], watched["run"]
    live = [s for s in seen if s["visible"] and s["state"] == "running"]
    assert live, "the page never showed the run while it ran"
    assert watched["same_document"] == 42  # it changed without a reload (server-sent events)
    finals = [int(s["final"]) for s in live]
    assert len(set(finals)) >= 3 and finals == sorted(finals), finals  # it moved as attempts finished
    assert any(int(s["running"]) > 0 for s in live) and any(s["rows"] > 0 for s in live)
    assert any(Decimal(s["spent"]) > 0 for s in live)  # spend against the cap, live from the run budget
    assert all(s["cap"] == "2.0" and s["source"] == "run budget (live)" for s in live)
    assert any(s["limits"] not in ("–", "unpaced") for s in live)  # the pool's pacer limits
    assert any(s["admitted"] not in (None, "–", "0.0") for s in live)  # the pool's admitted calls per minute

    with psycopg.connect(database_url) as conn:
        statuses = dict(conn.execute("SELECT status, count(*) FROM attempts WHERE run = %s GROUP BY status",
                                     (run,)).fetchall())
        calls, spent = conn.execute("SELECT count(*), sum(cost_usd) FROM calls WHERE run = %s", (run,)).fetchone()
    assert statuses == expected_statuses()
    assert end["state"] == "finished" and end["source"] == "ledger (final)"
    assert end["final"] == end["planned"] == str(sum(statuses.values()))
    assert {s: n for s, n in end["statuses"].items() if n} == statuses
    assert end["calls"] == str(calls) and end["in_flight"] == "0" and end["running"] == "0"
    assert end["spent"] == f"{spent:.6f}"  # to the micro-dollar


def test_the_report_of_the_demo_run(watched, browser, database_url):
    out = watched["tmp"] / "report-out"
    p = subprocess.run([sys.executable, "-m", "dispatcher", "report", watched["run"], "--out", str(out)],
                       env=watched["env"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out / "report" / "summary.json").read_text())["runs"][0]
    with psycopg.connect(database_url) as conn:
        total, out_tokens = conn.execute("SELECT sum(cost_usd), sum(output_tokens) FROM calls WHERE run = %s",
                                         (watched["run"],)).fetchone()
    assert Decimal(summary["cost"]["total_usd"]) == total and summary["tokens"]["output_tokens"] == out_tokens
    assert summary["resolved_instances"] == expected_statuses()["RESOLVED"]
    assert (out / f"gpt-4o-mini.{watched['run']}.json").exists()  # the official outputs, from the stored spec
    browser.get((out / "report" / "report.html").as_uri())
    assert browser.find_element("tag name", "h1").text == f"Run {watched['run']}"
    shoot(browser, IMAGES / "report.png", height=1900)


def test_the_judge_reads_the_demo_runs_trajectories(watched, database_url):
    from dispatcher.backends.local_services import LocalServices

    try:
        p = subprocess.run([sys.executable, "-m", "dispatcher", "judge", watched["run"]], env=watched["env"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    finally:
        LocalServices(Path(watched["env"]["EVALPLANE_STATE_DIR"]) / "runs" / watched["run"] / "judge").stop_all()
    assert p.returncode == 0, p.stderr[-3000:]
    with psycopg.connect(database_url) as conn:
        rows = dict(conn.execute("SELECT instance_id, answers->'solved'->>'answer' FROM judge_verdicts"
                                 " WHERE run = %s AND status = 'judged'", (watched["run"],)).fetchall())
        patches = dict(conn.execute("SELECT instance_id, patch_bytes > 0 FROM attempts WHERE run = %s",
                                    (watched["run"],)).fetchall())
    # The simulator's judge policy says solved where the agent submitted a patch: it read each real trajectory.
    assert rows == {iid: "true" if has_patch else "false" for iid, has_patch in patches.items()}
