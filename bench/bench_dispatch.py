"""Dispatch at scale: N simulated attempts (default 20,000, all live at once), planned, dispatched and landed in full.

    .venv/bin/python bench/bench_dispatch.py                                 # 20,000 concurrent, harness 420 s
    .venv/bin/python bench/bench_dispatch.py --concurrency 100 --task-s 0.2 --batches 0

The real dispatcher pieces (spec -> plan -> DriverLoop with the PoolPacer and two ResultsWriter Ray actors, job
documents in S3, SQS, PostgreSQL, Valkey) with the simulated tasks of bench/sim_launcher.py (their own process:
heartbeats, ledger batches while they run, then their result) in place of real ones. S3 and SQS are the stand-in
(dispatcher/moto_server.py), each service on its own server process. The run's keys are made as a run makes them
(dispatcher/run.py): each simulated task signs its messages with its attempt's key, and the writers verify every
message before landing it. Prints the targets' rows:
  - every attempt exactly one row, every call one ledger row, and the run ended;
  - the driver's pass time while every task is live, and its peak RSS (the fleet is not in this process);
  - the writer's landing rate into PostgreSQL (decoding and signature checks included, from message bodies already
    received) as a ratio
    to a raw COPY of the same rows into the same PostgreSQL, interleaved in five rounds in this run;
  - the wall time from the last result sent to the last row landed;
and, beside them, what the SQS stand-in costs: the writers' time split between the stand-in (receive, delete) and
their own work (decode, land), and the stand-in alone moving the same message mix with nothing landed.
Uses its own PostgreSQL database (dropped at the end).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg
from moto_proc import start_moto

BASE_DB = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")


def setup(tmp: Path, n: int, concurrency: int, result_wait_s: float) -> tuple[str, Path, list]:
    name, motos = make_database(), start_aws()
    return name, write_run(tmp, n, concurrency, result_wait_s), motos


def make_database() -> str:
    """A PostgreSQL database of the bench's own (DATABASE_URL names it from here on); the caller drops it."""
    name = f"ep_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(BASE_DB, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = BASE_DB.rsplit("/", 1)[0] + "/" + name
    return name


def start_aws() -> list:
    """S3 and SQS stand-ins, one server process each (they share no state); the caller terminates them."""
    motos = []
    for service in ("s3", "sqs"):
        proc, endpoint = start_moto()
        motos.append(proc)
        os.environ[f"AWS_ENDPOINT_URL_{service.upper()}"] = endpoint
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      RAY_USAGE_STATS_ENABLED="0")
    os.environ.pop("AWS_ENDPOINT_URL", None)
    return motos


def write_run(tmp: Path, n: int, concurrency: int, result_wait_s: float, pool: str | None = None, model: str = "",
              budget: str = "", statement: str = "", dataset: Path | None = None) -> Path:
    """A run's spec (and its n simulated instances) under tmp: pool (default: a fresh one), model and budget (more
    lines of those sections), statement (what follows each instance's problem statement), dataset (a folder the
    instances are written to once and read from by every run given it: one dataset for the ledger; default tmp)."""
    tmp.mkdir(parents=True, exist_ok=True)
    data = (dataset or tmp).resolve()
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "instances.jsonl").exists():
        rows = [{"instance_id": f"bench__sim-{i}", "repo": "bench/sim", "base_commit": "0" * 40, "version": "0.1",
                 "problem_statement": f"simulated instance {i} of {data.name}{statement}", "FAIL_TO_PASS": "[]",
                 "PASS_TO_PASS": "[]", "image": f"swebench/sweb.eval.x86_64.bench_1776_sim-{i}:latest",
                 "eval_script": "true", "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail", "patch": ""}
                for i in range(n)]
        (data / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (data / "repos").mkdir(exist_ok=True)
        (data / "repos" / "bench__sim.bundle").write_text("simulated")
    spec = tmp / "spec.toml"
    spec.write_text(f"""
[run]
name = "bench-{uuid.uuid4().hex[:6]}"
[harness]
name = "mini-swe-agent"
[model]
provider = "anthropic"
model = "claude-sonnet-4-5"
pool = "{pool or f"bench-{uuid.uuid4().hex[:6]}"}"
{model}
[instances]
dataset = "{data / "instances.jsonl"}"
repos = "{data / "repos"}"
[budget]
run_usd = 1000000
wall_time_s = 3600
{budget}
[backend]
concurrency = {concurrency}
writers = 2
result_wait_s = {result_wait_s}
""")
    return spec


def landing_ratio(sample: int, batches: int) -> dict[str, float]:
    """Writer rows/s (decoding the message bodies and landing them, as poll_once does with a full batch: the rate
    matters when the writers are behind, and then the queue holds a full batch) vs raw COPY rows/s of the same rows
    into the same tables (values prepared beforehand: ledger rows into calls, attempt rows with every column the
    writer fills into attempts, their harness phase rows into phases, foreign keys checked), same PostgreSQL, side by
    side in five interleaved rounds after an untimed warm-up round, each side in a database of its own (the same
    schema, the tables empty at the start: the run's 200,000 ledger rows would make the writer's indexes the larger).
    The bodies are the run's mix.
    Beside it, the bench's earlier baseline (raw COPY into copies of the tables without their foreign keys, attempt
    rows of 8 columns, no phase rows), and the CPU seconds each side cost (this process and its PostgreSQL backend),
    which a loaded machine stretches less than wall time."""
    names = [f"ep_bench_landing_{uuid.uuid4().hex[:6]}" for _ in range(2)]
    with psycopg.connect(BASE_DB, autocommit=True) as c:
        for name in names:
            c.execute(f'CREATE DATABASE "{name}"')
    try:
        return _landing_ratio(*(BASE_DB.rsplit("/", 1)[0] + "/" + name for name in names), sample, batches)
    finally:
        with psycopg.connect(BASE_DB, autocommit=True) as c:
            for name in names:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _backend_cpu_s(conn) -> float | None:
    """CPU seconds the connection's PostgreSQL backend has used (None unless the server runs on this machine)."""
    try:
        fields = Path(f"/proc/{conn.info.backend_pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cpu_s(*conns) -> float | None:
    backend = [_backend_cpu_s(c) for c in conns]
    return None if None in backend else time.process_time() + sum(backend)


class _Side:
    """One side of the comparison: its wall and CPU seconds."""

    def __init__(self, conn):
        self.conn, self.wall, self.cpu = conn, 0.0, 0.0

    def __enter__(self):
        self.t, self.c = time.perf_counter(), _cpu_s(self.conn)
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self.t
        c = _cpu_s(self.conn)
        self.cpu = None if c is None or self.c is None or self.cpu is None else self.cpu + c - self.c


def _landing_ratio(writer_db: str, copy_db: str, sample: int, batches: int) -> dict[str, float]:
    from psycopg.types.json import Jsonb
    from sim_launcher import messages

    from contract import db
    from contract.models import AttemptRef, AttemptResult, Envelope
    from contract.signing import RunKeys
    from dispatcher.backends import resources
    from dispatcher.driver.writer import _ATTEMPT_COLUMNS, _CALL_COLUMNS, Incoming, ResultsWriter

    run = f"landing-{uuid.uuid4().hex[:6]}"
    for url in (writer_db, copy_db):
        with psycopg.connect(url) as c:
            db.migrate(c)
            c.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, '{}', 'h', 'local', %s)",
                      (run, sample))
    rng = random.Random(7)
    run_keys = RunKeys(os.urandom(32).hex().encode(), os.urandom(32).hex().encode())
    signed = []  # (body, its attempt key's signature), as the run's tasks send them
    for i in range(sample):
        ref = AttemptRef(run=run, instance_id=f"x-{i}", attempt=1)
        sign = run_keys.attempt_signer(ref)
        signed += [(b, sign(b)) for b in messages(ref, "p", "claude-sonnet-4-5", rng, batches)]
    random.Random(8).shuffle(signed)  # as they arrive: batches and results of many tasks interleaved
    bodies = [b for b, _ in signed]
    envs = [Envelope.model_validate_json(b) for b in bodies]

    def call_row(r) -> tuple:  # what COPY needs: the values, JSON as Jsonb
        return tuple(Jsonb(v) if isinstance(v, dict) else v for v in (getattr(r, c) for c in _CALL_COLUMNS))

    def attempt_row(r: AttemptResult) -> tuple:  # every column the writer fills, with the values it lands
        t = r.totals
        return (run, r.ref.instance_id, r.ref.attempt, r.harness, r.pool, r.model, r.outcome.value, "EMPTY_PATCH",
                r.patch_uri, r.patch_bytes, r.trajectory_uri, t.calls, t.input_tokens, t.cached_tokens,
                t.cache_write_tokens, t.output_tokens, t.cost_usd, (r.ended_at - r.started_at).total_seconds(),
                r.started_at, r.ended_at, r.error)

    def phase_row(r: AttemptResult) -> tuple:
        return (run, r.ref.instance_id, r.ref.attempt, "harness", r.started_at, r.ended_at, r.outcome.value,
                Jsonb({"ledger_calls": r.ledger_calls, "error": r.error}))

    def copy(cur, table: str, columns, rows) -> None:
        with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as cp:
            for r in rows:
                cp.write_row(r)

    res = resources.RunResources(run=run, bucket="b", results_queue_url="q", eval_queue_url="e",
                                 verdict_queue_url="v", results_dlq_url="d", eval_dlq_url="d")
    writer = ResultsWriter(res, writer_db, keys=run_keys)

    def decode_checked(body: str, signature: str) -> Incoming:  # as poll_once: decode, then verify
        incoming = Incoming.decode(body)
        if why := writer.auth.refusal(res.results_queue_url, body, signature, incoming):
            raise RuntimeError(f"the writer refused a bench message: {why}")
        return incoming

    size = ResultsWriter.BATCH_MESSAGES
    rounds = 6  # interleaved, so a noisy moment on this shared machine hits every side; the first is a warm-up
    with psycopg.connect(copy_db) as c, psycopg.connect(writer_db) as earlier_c:
        earlier_c.execute("CREATE TABLE calls_copy (LIKE calls INCLUDING ALL)")  # same keys and indexes as calls
        earlier_c.execute("CREATE TABLE attempts_copy (LIKE attempts INCLUDING ALL)")
        earlier_c.commit()
        w_side, c_side, e_side = _Side(writer.conn), _Side(c), _Side(earlier_c)
        step = -(-len(envs) // rounds)
        timed_rows = 0
        for k in range(0, len(envs), step):
            part = envs[k:k + step]
            if k == 0:  # warm-up: each side's first round (connections, catalog and plan caches) is not timed
                sides = (_Side(writer.conn), _Side(c), _Side(earlier_c))
            else:
                sides = (w_side, c_side, e_side)
                timed_rows += sum(len(e.msg.rows) if e.msg.kind == "ledger" else 1 + len(e.msg.ledger) for e in part)
            with sides[0]:
                for i in range(k, k + len(part), size):  # as poll_once does: decode a batch's bodies, land them
                    writer.land([decode_checked(*m) for m in signed[i:min(i + size, k + len(part))]])
            results = [e.msg for e in part if e.msg.kind == "attempt_result"]
            calls = [call_row(r) for e in part for r in
                     (e.msg.rows if e.msg.kind == "ledger" else e.msg.ledger if e.msg.kind == "attempt_result" else [])]
            atts, phases = [attempt_row(r) for r in results], [phase_row(r) for r in results]
            with sides[1], c.cursor() as cur:
                copy(cur, "calls", _CALL_COLUMNS, calls)
                copy(cur, "attempts", _ATTEMPT_COLUMNS, atts)
                copy(cur, "phases", ("run", "instance_id", "attempt", "phase", "started_at", "ended_at", "outcome",
                                     "detail"), phases)
                c.commit()
            with sides[2], earlier_c.cursor() as cur:
                copy(cur, "calls_copy", _CALL_COLUMNS, calls)
                copy(cur, "attempts_copy", _ATTEMPT_COLUMNS[:8], [a[:8] for a in atts])
                earlier_c.commit()
    writer.close()
    cpu = c_side.cpu / w_side.cpu if w_side.cpu and c_side.cpu else float("nan")
    return {"writer": timed_rows / w_side.wall, "copy": timed_rows / c_side.wall, "ratio": c_side.wall / w_side.wall,
            "cpu_ratio": cpu, "earlier_copy": timed_rows / e_side.wall, "earlier_ratio": e_side.wall / w_side.wall,
            "rows": timed_rows, "batch": size}


def stand_in_alone(sample: int, batches: int) -> tuple[int, float]:
    """The SQS stand-in moving the run's message mix for `sample` tasks with nothing landed: 8 threads sending ten a
    call (as the fleet), 2 receiving ten a call up to a writer's batch and deleting ten a call (as the writers).
    Returns (messages, s)."""
    from sim_launcher import messages

    from contract import aws, signing
    from contract.models import AttemptRef
    from dispatcher.driver.message_auth import RECEIVE_ATTRIBUTES
    from dispatcher.driver.writer import ResultsWriter

    sqs = aws.client("sqs")
    url = sqs.create_queue(QueueName=f"standin-{uuid.uuid4().hex[:6]}", Attributes={"VisibilityTimeout": "120"})[
        "QueueUrl"]
    rng = random.Random(9)
    bodies = [b for i in range(sample) for b in messages(AttemptRef(run="s", instance_id=f"s-{i}", attempt=1), "p",
                                                          "m", rng, batches)]
    sign = signing.signer(os.urandom(32).hex().encode())  # the messages carry a signature, as the run's do
    got: set[str] = set()  # message ids: moto may hand one message to two receivers at once (a redelivery)
    lock = threading.Lock()
    sent = threading.Event()

    def send(k: int) -> None:
        for i in range(k * 10, len(bodies), 80):
            aws.send_batch(url, bodies[i:i + 10], sign=sign)

    def consume() -> None:
        while True:
            msgs: list[dict] = []
            for i in range(ResultsWriter.BATCH_MESSAGES // 10):
                more = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=RECEIVE_ATTRIBUTES,
                                           WaitTimeSeconds=1 if i == 0 else 0).get("Messages", [])
                msgs += more
                if len(more) < 10:
                    break
            if not msgs:
                if sent.is_set():
                    return
                continue
            for i in range(0, len(msgs), 10):
                sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(j), "ReceiptHandle": m["ReceiptHandle"]}
                                                                for j, m in enumerate(msgs[i:i + 10])])
            with lock:
                got.update(m["MessageId"] for m in msgs)

    senders = [threading.Thread(target=send, args=(k,)) for k in range(8)]
    consumers = [threading.Thread(target=consume) for _ in range(2)]
    t = time.perf_counter()
    for th in senders + consumers:
        th.start()
    for th in senders:
        th.join()
    sent.set()
    for th in consumers:
        th.join()
    took = time.perf_counter() - t
    sqs.delete_queue(QueueUrl=url)
    if len(got) != len(bodies):
        raise RuntimeError(f"the stand-in moved {len(got)} of {len(bodies)} messages")
    return len(bodies), took


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attempts", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=20000)
    ap.add_argument("--task-s", type=float, default=420.0,
                    help="simulated harness time of a task (each 1-1.25x this): longer than launching every task,"
                         " for all to be live at once")
    ap.add_argument("--batches", type=int, default=3,
                    help="ledger batches a task's shim sends while it runs (the last call's row rides with the"
                         " result); 0: every row rides with the result")
    ap.add_argument("--drop", type=int, default=0, help="results killed on their way (their tasks store their"
                                                        " ledger copy in S3): they land as lost_result")
    ap.add_argument("--result-wait-s", type=float, default=300.0, help="backend.result_wait_s of the run")
    ap.add_argument("--landing-sample", type=int, default=2000)
    ap.add_argument("--stand-in-sample", type=int, default=2000, help="tasks' messages the stand-in moves alone")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    os.environ["EVALPLANE_STATE_DIR"] = str(tmp / "state")
    dbname, spec_path, motos = setup(tmp, args.attempts, args.concurrency, args.result_wait_s)
    launcher = None
    try:
        import ray
        import redis
        from sim_launcher import CALLS_PER_TASK, SimLauncher

        from contract import aws, db
        from contract.signing import RunKeys
        from dispatcher import backends
        from dispatcher.backends import daemons, resources
        from dispatcher.backends.base import attempt_env
        from dispatcher.driver import loop as runmod
        from dispatcher.driver.actors import PoolPacer, ResultsWriterActor
        from dispatcher.plan import make_plan
        from dispatcher.spec import load_spec

        t0 = time.perf_counter()
        wall0 = time.time()
        marks: dict[str, float] = {}
        plan = make_plan(load_spec(spec_path))
        spec = plan.spec
        n = len(plan.refs)
        marks["planned"] = time.perf_counter() - t0
        conn = db.connect()
        db.migrate(conn)
        runmod.open_run(conn, plan)
        res = resources.ensure(spec.run.name)
        # as a run: the run secret and the verdict key in 0600 files the writers load; tasks get attempt keys
        key_files = (str(tmp / "run.key"), str(backends.for_spec(spec).verdict_key_file()))
        run_keys = RunKeys.load(*key_files)
        valkey_url = os.environ.get("VALKEY_URL", "redis://127.0.0.1:6379/0")
        aws_env = daemons.aws_env()
        runmod.ray_init(False, aws_env)
        marks["ray up"] = time.perf_counter() - t0
        writers = [ResultsWriterActor.options(name=f"results-writer:{spec.run.name}:{i}").remote(
            res.model_dump(), db.database_url(), aws_env, 60.0, key_files) for i in range(spec.backend.writer_count)]
        pacer = PoolPacer.options(name=f"pacer:{spec.pool}", get_if_exists=True).remote(spec.pool, valkey_url, {})
        drop = {r.instance_id for r in random.Random(3).sample(plan.refs, args.drop)} if args.drop else set()
        launcher = SimLauncher(res.results_queue_url, res.bucket, spec.pool, spec.model.model, valkey_url,
                               aws_env | {"DATABASE_URL": db.database_url()}, task_s=args.task_s,
                               batches=args.batches, drop=drop, expected=n, attempt_env=attempt_env(run_keys))
        loop = runmod.DriverLoop(plan, res, conn, redis.Redis.from_url(valkey_url), launcher, pacer,
                                 lambda ref: runmod.make_job(plan, res, ref, "http://gateway.invalid", valkey_url),
                                 run_keys)
        loop.PLAN_EVERY_S = 2.0
        passes: list[tuple[float, int]] = []  # (seconds, tasks live that the driver follows)
        backlog = (0, 0.0)  # the most results sent but not landed (as the driver last counted them), and when
        last_print = 0.0
        while True:
            p0 = time.perf_counter()
            done = loop.step()
            passes.append((time.perf_counter() - p0, launcher.launched - len(launcher.codes)))
            now = time.perf_counter() - t0
            if "all launched" not in marks and launcher.launched >= n:
                marks["all launched"] = now
            behind = (launcher.stats.get("results_sent") or 0) - sum(loop.counts.values())
            if behind > backlog[0]:
                backlog = (behind, now)
            if done:
                break
            if now - last_print > 15:
                st = launcher.stats
                depth = aws.client("sqs").get_queue_attributes(QueueUrl=res.results_queue_url, AttributeNames=[
                    "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
                landed = sum(loop.counts.values())
                print(f"  {now:6.1f}s launched {launcher.launched}, live {st.get('live')}, results sent"
                      f" {st.get('results_sent')}, landed {landed}, target {loop.target}; fleet: {st.get('queued')}"
                      f" messages waiting to be sent; results queue {depth['ApproximateNumberOfMessages']} visible +"
                      f" {depth['ApproximateNumberOfMessagesNotVisible']} in flight; last pass"
                      f" {passes[-1][0] * 1000:.0f} ms", file=sys.stderr, flush=True)
                last_print = now
            time.sleep(0.05 if loop.launch_backlog else 0.25)
        marks["run ended (every row landed)"] = time.perf_counter() - t0
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        launcher.drain()
        st = dict(launcher.stats)
        for k, at in (("all live at once", "all_live_at"), ("first message sent", "first_sent_at"),
                      ("first result sent", "first_result_at"), ("last result sent", "last_result_at")):
            if st.get(at):
                marks[k] = st[at] - wall0
        run = spec.run.name
        attempts, calls, lost, last_row = conn.execute(
            "SELECT (SELECT count(*) FROM attempts WHERE run=%s), (SELECT count(*) FROM calls WHERE run=%s),"
            " (SELECT count(*) FROM attempts WHERE run=%s AND error LIKE 'lost_result:%%'),"
            " (SELECT extract(epoch FROM max(landed_at)) FROM attempts WHERE run=%s AND error IS NULL)",
            (run, run, run, run)).fetchone()
        conn.commit()
        marks["last row landed"] = float(last_row) - wall0
        busy_w: dict[str, float] = {}
        landed_w: dict[str, int] = {}
        polls = redelivered = 0
        for s in ray.get([w.stop.remote() for w in writers]):
            for k, v in s["busy_s"].items():
                busy_w[k] = busy_w.get(k, 0.0) + v
            for k, v in s["landed"].items():
                landed_w[k] = landed_w.get(k, 0) + v
            polls += s["batches"]
            redelivered += s["redelivered_batches"]
        launcher.close()

        live_all = [d for d, live in passes if live >= n]
        print(f"dispatch benchmark: {n} attempts, concurrency {args.concurrency}, harness {args.task_s:g}-"
              f"{args.task_s * 1.25:g} s a task, {CALLS_PER_TASK} calls each ({args.batches} ledger batches while it"
              f" runs, then its result), {args.drop} results dropped; {os.cpu_count()} cores, shared: load average"
              f" {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the run's end")
        print("  timeline:")
        for k, v in sorted(marks.items(), key=lambda kv: kv[1]):
            print(f"    {k:<40} at {v:7.1f} s")
        ended = attempts == n
        refused = int(aws.client("sqs").get_queue_attributes(QueueUrl=res.results_dlq_url, AttributeNames=[
            "ApproximateNumberOfMessages"])["Attributes"]["ApproximateNumberOfMessages"])
        print(f"  rows: {attempts} attempts (expected {n}), {calls} ledger rows (expected {CALLS_PER_TASK * n}),"
              f" {lost} lost_result (expected {args.drop}), {refused} messages dead-lettered (expected 0); the run"
              f" ended: {verdict(ended and calls == CALLS_PER_TASK * n and lost == args.drop and not refused)}")
        print(f"  live tasks: peak {st.get('peak_live')}; passes with all {n} live: {len(live_all)}")
        if live_all:
            ranked = sorted(live_all)
            print(f"  driver pass at {n} live tasks: p50 {statistics.median(ranked) * 1000:.0f} ms, p95"
                  f" {ranked[int(0.95 * (len(ranked) - 1))] * 1000:.0f} ms, max {ranked[-1] * 1000:.0f} ms"
                  f" (target max <= 1000 ms: {verdict(ranked[-1] <= 1.0)})")
        finishing = sorted(d for d, live in passes[passes.index(next(p for p in passes if p[1] >= n)):]
                           if live < n) if live_all else []
        if finishing:
            print(f"  driver pass while the tasks finish (and their rows land): p50"
                  f" {statistics.median(finishing) * 1000:.0f} ms, max {finishing[-1] * 1000:.0f} ms")
        print(f"  driver pass over the whole run: {len(passes)} passes, max {max(d for d, _ in passes) * 1000:.0f} ms"
              f" (the first starts the PoolPacer actor); time per stage: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in loop.busy_s.items()))
        print(f"  driver peak RSS {rss_mb:.0f} MB (target <= 1536 MB: {verdict(rss_mb <= 1536)})")
        gap = marks["last row landed"] - marks.get("last result sent", marks["last row landed"])
        print(f"  last result sent -> last row landed: {gap:.1f} s (target <= 30 s: {verdict(gap <= 30)}); the writers"
              f" were at most {backlog[0]} results behind the tasks (at {backlog[1]:.0f} s)")
        load_before = os.getloadavg()[0]
        # in a fresh interpreter, as the writer lands in its own actor process: this one holds the whole run's
        # objects, and its garbage collector's passes over them would be charged to the writer's decoding
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            lr = pool.submit(landing_ratio, args.landing_sample, args.batches).result()
        print(f"  writer landing {lr['writer']:,.0f} rows/s vs raw COPY of the same rows into the same tables"
              f" {lr['copy']:,.0f} rows/s: ratio {lr['ratio']:.2f} (target >= 0.5: {verdict(lr['ratio'] >= 0.5)});"
              f" {lr['rows']:,} rows, the writer's batches of {lr['batch']} messages; CPU seconds (its process and its"
              f" PostgreSQL backend), raw COPY / writer: {lr['cpu_ratio']:.2f}; the earlier baseline (copies of the"
              f" tables without foreign keys, 8-column attempt rows, no phase rows) {lr['earlier_copy']:,.0f} rows/s,"
              f" ratio {lr['earlier_ratio']:.2f}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f}"
              f" after ({os.cpu_count()} cores)")
        stand_in = busy_w.get("receive", 0) + busy_w.get("delete", 0)
        own = busy_w.get("decode", 0) + busy_w.get("land", 0)
        msgs = sum(landed_w.values())
        print(f"  results writers ({len(writers)}): {msgs} messages in {polls} batches ({msgs / max(polls, 1):.1f} a"
              f" batch; {redelivered} landed again for a repeated row); time in the SQS stand-in (receive, waiting"
              f" for messages included, and delete) {stand_in:.1f} s, in their own work (decode, land) {own:.1f} s: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in busy_w.items()))
        print(f"  fleet: {st.get('messages_sent')} messages in {st.get('send_calls')} SendMessageBatch calls,"
              f" {st.get('send_busy_s', 0):.1f} s of sender time")
        m, took = stand_in_alone(args.stand_in_sample, args.batches)
        print(f"  the SQS stand-in alone, the same mix, nothing landed: {m} messages sent, received and deleted in"
              f" {took:.1f} s = {m / took:,.0f} messages/s; the run moved {msgs} messages through it at"
              f" {msgs / max(marks['last row landed'] - marks.get('first message sent', 0), 1e-9):,.0f} messages/s"
              f" (first message sent to last row landed)")
        conn.close()
        ray.shutdown()
        return 0 if ended and calls == CALLS_PER_TASK * n else 1
    finally:
        if launcher is not None and launcher.proc.is_alive():
            launcher.proc.terminate()
        for m in motos:
            m.terminate()
        with psycopg.connect(BASE_DB, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())
