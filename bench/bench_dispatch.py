"""Dispatch at scale: a simulated run of N attempts (default 20,000), planned, dispatched and landed in full.

    .venv/bin/python bench/bench_dispatch.py [--attempts 20000] [--landing-sample 2000]

The real dispatcher pieces (spec -> plan -> DriverLoop with the PoolPacer and ResultsWriter Ray actors,
job documents in S3, SQS, PostgreSQL) with the `sim` launcher of bench/sim_launcher.py in place of real
tasks. Prints wall time by stage, the driver's peak RSS, and the writer's landing rate into PostgreSQL
(from messages already received) as a ratio to a raw COPY of the same rows into the same PostgreSQL,
measured side by side in this run. Uses its own PostgreSQL database (dropped at the end) and its own
moto server process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg
from moto_proc import start_moto

BASE_DB = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")


def setup(tmp: Path, n: int, concurrency: int) -> tuple[str, Path, list[subprocess.Popen]]:
    name = f"ep_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(BASE_DB, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    db_url = BASE_DB.rsplit("/", 1)[0] + "/" + name
    # One moto server per service (S3, SQS): each is a single Python process, and they share no state.
    motos = []
    for service in ("s3", "sqs"):
        proc, endpoint = start_moto()
        motos.append(proc)
        os.environ[f"AWS_ENDPOINT_URL_{service.upper()}"] = endpoint
    os.environ.update(DATABASE_URL=db_url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", RAY_USAGE_STATS_ENABLED="0")
    os.environ.pop("AWS_ENDPOINT_URL", None)
    # n synthetic instances in the swebench 5.x shape, one repository
    rows = [{"instance_id": f"bench__sim-{i}", "repo": "bench/sim", "base_commit": "0" * 40, "version": "0.1",
             "problem_statement": f"simulated instance {i}", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]",
             "image": f"swebench/sweb.eval.x86_64.bench_1776_sim-{i}:latest", "eval_script": "true",
             "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail", "patch": ""} for i in range(n)]
    (tmp / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "repos").mkdir()
    (tmp / "repos" / "bench__sim.bundle").write_text("simulated")
    spec = tmp / "spec.toml"
    spec.write_text(f"""
[run]
name = "bench-{uuid.uuid4().hex[:6]}"
[harness]
name = "mini-swe-agent"
[model]
provider = "anthropic"
model = "claude-sonnet-4-5"
[instances]
dataset = "instances.jsonl"
repos = "repos"
[budget]
run_usd = 100000
[backend]
concurrency = {concurrency}
writers = 2
""")
    return name, spec, motos


def landing_ratio(db_url: str, sample: int) -> tuple[float, float, float]:
    """Writer rows/s (decoding the message bodies and landing them, as poll_once does) vs raw COPY rows/s of the
    same rows (values prepared beforehand), same PostgreSQL, side by side."""
    from psycopg.types.json import Jsonb
    from sim_launcher import messages

    from contract.models import AttemptRef, Envelope
    from dispatcher import resources
    from dispatcher.writer import _CALL_COLUMNS, Incoming, ResultsWriter

    def copy_row(r) -> tuple:  # what COPY needs: the values, JSON as Jsonb
        return tuple(Jsonb(v) if isinstance(v, dict) else v for v in (getattr(r, c) for c in _CALL_COLUMNS))

    run = f"landing-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(db_url) as c:
        c.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, '{}', 'h', 'local', %s)",
                  (run, sample))
    rng = random.Random(7)
    bodies = [b for i in range(sample)
              for b in messages(AttemptRef(run=run, instance_id=f"x-{i}", attempt=1), "p", "claude-sonnet-4-5", rng)]
    envs = [Envelope.model_validate_json(b) for b in bodies]
    n_rows = sum(len(e.msg.rows) if e.msg.kind == "ledger" else 1 + len(e.msg.ledger) for e in envs)
    res = resources.RunResources(run=run, bucket="b", results_queue_url="q", eval_queue_url="e",
                                 results_dlq_url="d", eval_dlq_url="d")
    writer = ResultsWriter(res, db_url)
    writer_s = copy_s = 0.0
    rounds = 5  # interleaved, so a noisy moment on this shared machine hits both sides
    with psycopg.connect(db_url) as c:
        c.execute("CREATE TABLE calls_copy (LIKE calls INCLUDING ALL)")  # same keys and indexes as calls
        c.execute("CREATE TABLE attempts_copy (LIKE attempts INCLUDING ALL)")
        c.commit()
        step = -(-len(envs) // rounds)
        for k in range(0, len(envs), step):
            part = envs[k:k + step]
            t = time.perf_counter()
            for i in range(k, k + len(part), 50):  # as the writer does: decode up to 5 receives of 10, land them
                writer.land([Incoming.decode(b) for b in bodies[i:min(i + 50, k + len(part))]])
            writer_s += time.perf_counter() - t
            calls = [copy_row(r) for e in part for r in
                     (e.msg.rows if e.msg.kind == "ledger" else e.msg.ledger if e.msg.kind == "attempt_result" else [])]
            atts = [(run, e.msg.ref.instance_id, 1, "h", "p", "m", "submitted", "EMPTY_PATCH")
                    for e in part if e.msg.kind == "attempt_result"]
            t = time.perf_counter()
            with c.cursor() as cur:
                with cur.copy(f"COPY calls_copy ({', '.join(_CALL_COLUMNS)}) FROM STDIN") as cp:
                    for r in calls:
                        cp.write_row(r)
                with cur.copy("COPY attempts_copy (run, instance_id, attempt, harness, pool, model, outcome, status)"
                              " FROM STDIN") as cp:
                    for r in atts:
                        cp.write_row(r)
            c.commit()
            copy_s += time.perf_counter() - t
    return n_rows / writer_s, n_rows / copy_s, (n_rows / writer_s) / (n_rows / copy_s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attempts", type=int, default=20000)
    ap.add_argument("--landing-sample", type=int, default=2000)
    ap.add_argument("--task-s", type=float, default=0.2, help="simulated task run time (mean)")
    ap.add_argument("--concurrency", type=int, default=100,
                    help="backend.concurrency: moto's SQS scans its whole queue for every message it receives, so a"
                         " deep queue (many tasks finishing at once) makes the stand-in, not the dispatcher, the limit")
    ap.add_argument("--split-ledger", action="store_true",
                    help="each task sends its ledger batch and its result as two messages (a task whose shim sent"
                         " its rows during the run), instead of the rows riding with the result")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    os.environ["EVALPLANE_STATE_DIR"] = str(tmp / "state")
    dbname, spec_path, motos = setup(tmp, args.attempts, args.concurrency)
    try:
        import ray
        import redis
        from sim_launcher import SimLauncher

        from contract import aws, db
        from dispatcher import localstack, resources
        from dispatcher import run as runmod
        from dispatcher.actors import PoolPacer, ResultsWriterActor
        from dispatcher.plan import make_plan
        from dispatcher.spec import load_spec

        t0 = time.perf_counter()
        marks: dict[str, float] = {}
        plan = make_plan(load_spec(spec_path))
        spec = plan.spec
        marks["planned"] = time.perf_counter() - t0
        conn = db.connect()
        db.migrate(conn)
        runmod.open_run(conn, plan)
        res = resources.ensure(spec.run.name)
        valkey_url = os.environ.get("VALKEY_URL", "redis://127.0.0.1:6379/0")
        aws_env = localstack.aws_env()
        runmod.ray_init(False, aws_env)
        marks["ray up"] = time.perf_counter() - t0
        writers = [ResultsWriterActor.options(name=f"results-writer:{spec.run.name}:{i}").remote(
            res.model_dump(), db.database_url(), aws_env, 60.0) for i in range(spec.backend.writer_count)]
        pacer = PoolPacer.options(name=f"pacer:{spec.pool}", get_if_exists=True).remote(spec.pool, valkey_url, {})
        launcher = SimLauncher(res.results_queue_url, spec.pool, spec.model.model, task_s=args.task_s,
                               valkey=redis.Redis.from_url(valkey_url), split=args.split_ledger)
        loop = runmod.DriverLoop(plan, res, conn, redis.Redis.from_url(valkey_url), launcher, pacer,
                                 lambda ref: runmod.make_job(plan, res, ref, "http://gateway.invalid", valkey_url))
        loop.PLAN_EVERY_S = 2.0
        n = len(plan.refs)
        last_print = 0.0
        while not loop.step():
            now = time.perf_counter() - t0
            if "launched" not in marks and launcher.launched >= n:
                marks["job documents written + tasks launched"] = now
                marks["launched"] = now
            if "received" not in marks:
                got = sum(s["landed"]["attempt_result"] for s in ray.get([w.state.remote() for w in writers]))
                if got >= n:
                    marks["results received"] = now
                    marks["received"] = now
            if now - last_print > 15:
                depth = aws.client("sqs").get_queue_attributes(
                    QueueUrl=res.results_queue_url, AttributeNames=["ApproximateNumberOfMessages",
                                                                    "ApproximateNumberOfMessagesNotVisible"])
                print(f"  {now:6.1f}s launched {launcher.launched}, target {loop.target}, results queue depth"
                      f" {depth['Attributes']['ApproximateNumberOfMessages']} visible +"
                      f" {depth['Attributes']['ApproximateNumberOfMessagesNotVisible']} in flight", file=sys.stderr)
                last_print = now
            time.sleep(0.2)
        marks["rows landed"] = time.perf_counter() - t0
        marks.setdefault("results received", marks["rows landed"])
        total = time.perf_counter() - t0
        attempts, calls = conn.execute(
            "SELECT (SELECT count(*) FROM attempts WHERE run=%s), (SELECT count(*) FROM calls WHERE run=%s)",
            (spec.run.name, spec.run.name)).fetchone()
        jobs = aws.client("s3").list_objects_v2(Bucket=res.bucket, Prefix=f"runs/{spec.run.name}/jobs/", MaxKeys=1)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        busy_w: dict[str, float] = {}
        for st in ray.get([w.stop.remote() for w in writers]):
            for k, v in st["busy_s"].items():
                busy_w[k] = busy_w.get(k, 0.0) + v
        print(f"dispatch benchmark: {n} attempts, {len(launcher.done)} sim tasks, 10 calls each, 2 cores")
        for k in ("planned", "ray up", "job documents written + tasks launched", "results received", "rows landed"):
            print(f"  {k:<40} at {marks[k]:7.1f} s")
        print("  time spent per stage (the stages overlap: tasks run while others launch and land):")
        print("    driver (one thread):      " + ", ".join(f"{k} {v:.1f} s" for k, v in loop.busy_s.items()))
        print(f"    results writers ({len(writers)}):     " + ", ".join(f"{k} {v:.1f} s" for k, v in busy_w.items()))
        print(f"  total wall time                          {total:7.1f} s   (target < 300 s: "
              f"{'PASS' if total < 300 else 'MISS'})")
        print(f"  rows: {attempts} attempts, {calls} ledger rows (expected {n} and {10 * n}); job documents in S3:"
              f" {'yes' if jobs.get('KeyCount') else 'no'}")
        print(f"  driver peak RSS                          {rss_mb:7.0f} MB (target <= 1536 MB: "
              f"{'PASS' if rss_mb <= 1536 else 'MISS'})")
        w_rate, c_rate, ratio = landing_ratio(db.database_url(), args.landing_sample)
        print(f"  writer landing {w_rate:,.0f} rows/s vs raw COPY {c_rate:,.0f} rows/s: ratio {ratio:.2f}"
              f" (target >= 0.3: {'PASS' if ratio >= 0.3 else 'MISS'})")
        ok = attempts == n and calls == 10 * n
        conn.close()
        ray.shutdown()
        return 0 if ok else 1
    finally:
        for m in motos:
            m.terminate()
        with psycopg.connect(BASE_DB, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())
