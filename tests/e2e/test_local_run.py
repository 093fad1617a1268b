"""End to end on one machine: dispatcher (Ray driver) -> tasks (mini-swe-agent + shim) -> simulator ->
results queue -> writer -> eval worker (official grading) -> rows, predictions.jsonl and the report JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import redis

from contract import keys

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "examples" / "synthetic"
pytestmark = pytest.mark.e2e


def instances() -> list[dict]:
    return [json.loads(line) for line in (SYNTHETIC / "instances.jsonl").read_text().splitlines() if line.strip()]


def demo_expectation() -> dict[str, str]:
    policy = json.loads((SYNTHETIC / "demo_policy.json").read_text())["instances"]
    want = {}
    for row in instances():
        action = policy.get(row["instance_id"], {}).get("action", "gold")
        want[row["instance_id"]] = {"gold": "RESOLVED", "patch": "UNRESOLVED", "empty": "EMPTY_PATCH"}[action]
    return want


def without_gateway(text: str) -> str:
    """A spec's text without its [gateway] table: the demo spec's calls then go from the shim straight to the
    simulator. For the tests whose point is not the gateway tier (which each would start two LiteLLM replicas of
    their own) or whose behaviour it changes (injected errors, outages, lost verdicts, the spec's own checks)."""
    kept, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("["):
            inside = line.split("#", 1)[0].strip() == "[gateway]"
        if not inside:
            kept.append(line)
    return "".join(kept)


def write_spec(tmp_path: Path, run: str, concurrency: int = 2, gateway: bool = True) -> Path:
    """The demo spec (examples/local.toml) under run name `run`, its paths absolute; gateway=False: without_gateway."""
    text = (ROOT / "examples" / "local.toml").read_text()
    if not gateway:
        text = without_gateway(text)
    text = text.replace('name = "local-demo"', f'name = "{run}"')
    text = text.replace('"synthetic/', f'"{SYNTHETIC}/')
    text = text.replace("concurrency = 2", f"concurrency = {concurrency}")
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    return spec


def dispatcher(env, *args, timeout=400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dispatcher", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, check=False)


def counts(database_url: str, run: str) -> dict:
    with psycopg.connect(database_url) as conn:
        status = dict(conn.execute("SELECT instance_id, status FROM attempts WHERE run=%s", (run,)).fetchall())
        per_attempt = conn.execute(
            """SELECT a.instance_id, count(c.*), coalesce(sum(c.input_tokens + c.cached_tokens), 0),
                      coalesce(sum(c.output_tokens), 0), a.calls
               FROM attempts a LEFT JOIN calls c USING (run, instance_id, attempt)
               WHERE a.run=%s GROUP BY a.instance_id, a.calls""", (run,)).fetchall()
        calls = conn.execute("SELECT count(*), count(DISTINCT call_id) FROM calls WHERE run=%s", (run,)).fetchone()
        phases = conn.execute("SELECT phase, count(*) FROM phases WHERE run=%s GROUP BY phase", (run,)).fetchall()
        run_row = conn.execute("SELECT status FROM runs WHERE run=%s", (run,)).fetchone()
    return {"status": status, "per_attempt": per_attempt, "calls": calls, "phases": dict(phases),
            "run": run_row and run_row[0]}


def test_demo_run_end_to_end_and_rerun_reports(tmp_path, env, database_url, unique):
    spec = write_spec(tmp_path, unique)
    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-4000:]
    want = demo_expectation()
    got = counts(database_url, unique)
    assert got["status"] == want
    assert got["run"] == "finished"
    for iid, n_calls, tokens_in, tokens_out, attempt_calls in got["per_attempt"]:
        assert n_calls >= 1 and tokens_in > 0 and tokens_out > 0, iid
        assert attempt_calls == n_calls, iid  # the attempt's totals agree with its ledger
    assert got["calls"][0] == got["calls"][1]
    assert got["phases"]["harness"] == len(want)
    assert got["phases"]["eval"] == sum(1 for s in want.values() if s != "EMPTY_PATCH")

    report = json.loads((tmp_path / "out" / f"gpt-4o-mini.{unique}.json").read_text())
    for key in ("resolved_ids", "unresolved_ids", "empty_patch_ids", "error_ids", "completed_ids", "submitted_ids",
                "total_instances", "resolved_instances", "schema_version"):
        assert key in report
    assert sorted(report["resolved_ids"]) == sorted(i for i, s in want.items() if s == "RESOLVED")
    assert sorted(report["unresolved_ids"]) == sorted(i for i, s in want.items() if s == "UNRESOLVED")
    assert sorted(report["empty_patch_ids"]) == sorted(i for i, s in want.items() if s == "EMPTY_PATCH")
    assert report["error_ids"] == []
    preds = [json.loads(x) for x in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert {p["instance_id"] for p in preds} == set(want)
    assert all(p["model_name_or_path"] == "gpt-4o-mini" for p in preds)
    assert "RESOLVED" in p.stdout  # the results table

    # The same spec again: reports the finished run, lands nothing new.
    again = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out2"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is finished" in again.stderr
    assert counts(database_url, unique) == got


def _job_documents_written(env, run) -> int:
    import boto3

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    try:
        return s3.list_objects_v2(Bucket="evalplane-local", Prefix=f"runs/{run}/jobs/").get("KeyCount", 0)
    except s3.exceptions.NoSuchBucket:
        return 0


KILL_POINTS = {
    # during launch: job documents exist, no attempt has landed yet
    "launch": lambda env, db_url, run, landed: _job_documents_written(env, run) >= 1,
    # during harness tasks: attempts landed since the last driver died, others still running
    "harness": lambda env, db_url, run, landed: len(counts(db_url, run)["status"]) > landed,
    # during grading: a patch is waiting for (or in) the grader, landed since the last driver died
    "grading": lambda env, db_url, run, landed: (len(st := counts(db_url, run)["status"]) > landed
                                                 and "PATCH_READY" in st.values()),
}


def test_kill_9_and_resume_lands_every_attempt_once(tmp_path, env, database_url, unique):
    """One run whose driver is killed three times, once at each point (during launch, during harness tasks, during
    grading), each kill followed by `resume` in a new driver; the last resume finishes the run."""
    spec = write_spec(tmp_path, unique, concurrency=1, gateway=False)
    landed, command = 0, "run"
    for point, reached in KILL_POINTS.items():
        proc = subprocess.Popen([sys.executable, "-m", "dispatcher", command, str(spec)], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not reached(env, database_url, unique, landed):
            time.sleep(0.2)
        assert proc.poll() is None, f"the run ended before the kill point {point!r}"
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray workers; its tasks and services live on
        proc.wait()
        before = counts(database_url, unique)
        assert len(before["status"]) < len(demo_expectation()), point
        landed, command = len(before["status"]), "resume"

    p = dispatcher(env, "resume", str(spec), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-4000:]
    after = counts(database_url, unique)
    assert after["status"] == demo_expectation()  # every attempt exactly one row, with the right outcome
    assert after["calls"][0] == after["calls"][1]  # no ledger row duplicated
    for iid, n_calls, *_, attempt_calls in after["per_attempt"]:
        assert n_calls == attempt_calls, iid  # ... or lost
    assert after["phases"]["harness"] == len(demo_expectation())
    # No attempt was launched twice: one task start per attempt across all four drivers.
    starts = {}
    for log in (Path(env["EVALPLANE_STATE_DIR"]) / "runs" / unique / "tasks").glob("*.task.log"):
        starts[log.name] = log.read_text().count("task started for")
    assert starts and all(n == 1 for n in starts.values()), starts
    assert len(starts) == len(demo_expectation())


def test_different_spec_under_same_run_name_is_refused(tmp_path, env, database_url, unique):
    spec = write_spec(tmp_path, unique, gateway=False)
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, '{}', 'other', 'local', 1)",
                     (unique,))
    p = dispatcher(env, "run", str(spec))
    assert p.returncode == 3
    assert "different spec" in p.stderr
    assert counts(database_url, unique)["status"] == {}


def test_cancel_stops_the_run_and_lands_every_attempt(tmp_path, env, database_url, unique):
    spec = write_spec(tmp_path, unique, concurrency=1, gateway=False)
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "run", str(spec)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not counts(database_url, unique)["status"]:
        time.sleep(0.3)
    c = dispatcher(env, "cancel", str(spec))
    assert c.returncode == 0, c.stderr
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    got = counts(database_url, unique)
    assert got["run"] == "cancelled"
    assert set(got["status"]) == set(demo_expectation())  # every attempt still lands exactly one row
    assert "CANCELLED" in got["status"].values()
    assert got["calls"][0] == got["calls"][1]
    assert dispatcher(env, "cancel", str(spec)).returncode == 1  # nothing running to cancel


def task_pids(run: str) -> list[int]:
    """The task runners (`python -m harness <job-uri>`) of a run on this machine: its name is in the job's URI."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"harness" in argv[1:3] and any(run.encode() in a for a in argv[3:]):
            pids.append(int(proc.name))
    return pids


def test_a_task_stopped_from_outside_is_landed_by_the_dispatcher_never_as_cancelled(tmp_path, env, database_url,
                                                                                   unique):
    """A SIGTERM the dispatcher did not send (Spot taking a task's capacity back, an operator's StopTask): the task
    sends its unsent ledger rows and no result; the dispatcher lands the attempt from why the task ended (here the
    process launcher knows none: task_died; on ECS, spot_interrupted, which is relaunched), never as cancelled."""
    row = instances()[1]
    (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
    spec = write_spec(tmp_path, unique, gateway=False)
    text = spec.read_text().replace(f'dataset = "{SYNTHETIC}/instances.jsonl"', f'dataset = "{tmp_path}/one.jsonl"')
    # the provider down from its first call: the shim holds the task's calls, so the task is mid-harness when stopped
    # (a pool of its own: the outage breaker is the pool's)
    text = text.replace("[model]\n", f'[model]\npool = "{unique}"\n', 1)
    spec.write_text(text + "outage_after_calls = 0\noutage_s = 600\noutage_status = 529\n")
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "run", str(spec), "--out", str(tmp_path / "out")],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (pids := task_pids(unique)):
            assert time.monotonic() < deadline and proc.poll() is None, "no task started"
            time.sleep(0.5)
        # its first call made and failing (the shims report each 5xx to the pool's outage breaker), so that the task
        # is stopped with a call of its own in flight
        valkey = redis.Redis.from_url(env["VALKEY_URL"])
        while not valkey.exists(keys.pool_breaker(unique)):
            assert time.monotonic() < deadline and proc.poll() is None, "no call reached the provider"
            time.sleep(0.5)
        assert task_pids(unique) == pids
        os.killpg(pids[0], signal.SIGTERM)  # the process launcher starts each task in a session of its own
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with psycopg.connect(database_url) as conn:
        got = conn.execute("SELECT outcome, status, error, calls FROM attempts WHERE run = %s", (unique,)).fetchall()
        calls = conn.execute("SELECT count(*) FROM calls WHERE run = %s", (unique,)).fetchone()[0]
    assert len(got) == 1 and got[0][:2] == ("infra_error", "INFRA_ERROR"), got
    assert got[0][2].startswith("task_died: exited with code 143 without sending its result"), got
    assert got[0][3] == calls > 0  # its calls, every one a row, from what it sent and its S3 ledger copy
    report = json.loads((tmp_path / "out" / f"gpt-4o-mini.{unique}.json").read_text())
    assert report["infra_failure_ids"] == [row["instance_id"]]


def test_an_attempt_that_cannot_set_up_is_an_infrastructure_failure_not_an_empty_patch(tmp_path, env, database_url,
                                                                                      unique):
    """Its base commit is not in the repository's bundle, so the task fails before the agent can work: the row is
    INFRA_ERROR, and the official report lists it in infra_failure_ids, never in empty_patch_ids."""
    row = instances()[1]
    row = {**row, "instance_id": "evalplane__calc-9", "base_commit": "f" * 40}
    (tmp_path / "broken.jsonl").write_text(json.dumps(row) + "\n")
    spec = write_spec(tmp_path, unique, gateway=False)
    spec.write_text(spec.read_text().replace(f'dataset = "{SYNTHETIC}/instances.jsonl"',
                                             f'dataset = "{tmp_path}/broken.jsonl"'))
    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-4000:]
    with psycopg.connect(database_url) as conn:
        got = conn.execute("SELECT outcome, status, error FROM attempts WHERE run = %s", (unique,)).fetchall()
    assert len(got) == 1 and got[0][:2] == ("infra_error", "INFRA_ERROR"), got
    assert "f" * 40 in got[0][2]
    report = json.loads((tmp_path / "out" / f"gpt-4o-mini.{unique}.json").read_text())
    assert report["infra_failure_ids"] == ["evalplane__calc-9"] and report["empty_patch_ids"] == []
    assert report["unresolved_ids"] == [] and report["failure_reasons"] == {"evalplane__calc-9": "setup_failed"}


def test_a_provider_refusing_past_every_retry_is_an_infrastructure_failure(tmp_path, env, database_url, unique):
    """Every upstream call is a 429 (a limit, not an outage: 5xx streaks trip the pool's breaker, which the outage
    tests cover): the shim absorbs them until its retries (or the attempt's wall time) run out, then ends the session; the attempt lands infra_error/rate_limited, its calls are in the ledger, and the
    official report lists it among the infrastructure failures, never as the model's."""
    row = instances()[1]
    (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
    spec = write_spec(tmp_path, unique, gateway=False)
    text = spec.read_text().replace(f'dataset = "{SYNTHETIC}/instances.jsonl"', f'dataset = "{tmp_path}/one.jsonl"')
    text = text.replace("wall_time_s = 300", "wall_time_s = 45") + "error_rate = 1.0\nerror_statuses = [429]\n"
    spec.write_text(text)
    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-4000:]
    with psycopg.connect(database_url) as conn:
        got = conn.execute("SELECT outcome, status, error FROM attempts WHERE run = %s", (unique,)).fetchall()
        calls = conn.execute("SELECT outcome, retries FROM calls WHERE run = %s", (unique,)).fetchall()
    assert len(got) == 1 and got[0][:2] == ("infra_error", "INFRA_ERROR") and got[0][2].startswith("rate_limited")
    assert calls and calls[-1][0] == "rate_limited" and all(o != "ok" for o, _ in calls)
    report = json.loads((tmp_path / "out" / f"gpt-4o-mini.{unique}.json").read_text())
    assert report["infra_failure_ids"] == [row["instance_id"]]
    assert report["failure_reasons"] == {row["instance_id"]: "rate_limited"}
    assert report["unresolved_ids"] == report["empty_patch_ids"] == report["resolved_ids"] == []
