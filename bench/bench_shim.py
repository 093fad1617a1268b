"""The shim's cost, measured side by side in one run with a LiteLLM proxy (the venv's own, DB-less, 1 worker),
against the provider simulator and the real Valkey.

    .venv/bin/python bench/bench_shim.py [--quick] [--valkey redis://127.0.0.1:6379/0] [--only SECTION ...]

Every shim here has an attempt cap, a run cap and pool limits set (none binding), so each call takes and
settles real holds and books the pool's rpm/itpm/otpm. The same client (aiohttp) calls the simulator directly,
through the shim and through LiteLLM, on Anthropic's /v1/messages. Prints a PASS/MISS per target (issue 23):
  1. added latency over a direct call (each way's percentile less direct's, end to end), at concurrency 1
     (the three ways taking turns) and 16 (each way in turn under 16 callers of its own), non-stream and
     stream (first byte: the head; first content event; last byte): p50 <= 3 ms, p99 <= 10 ms, and below
     LiteLLM's;
  2. the shim process's CPU per call against an instant simulator, half streams, ledger rows sent to a results
     queue (SQS in moto's server mode, as in a task): <= 1 ms; LiteLLM's on the same calls beside it;
  3. the shim's RSS after that run, its results queue's client loaded: <= 120 MB; exec to ready: <= 1.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moto_proc import start_moto

from contract import keys
from plumbing.services import Service
from shim.child import shim_service
from shim.config import ShimConfig
from simulator import SimulatorConfig
from simulator.testing import simulator_process
from tests.conftest import free_port

KEY = "sk-bench-" + uuid.uuid4().hex
TOKEN = "bench-local-token"
MODEL = "claude-sonnet-4-5"
INSTANT = "instant/" + MODEL  # LiteLLM's name for the instant simulator (section 2)
BODY = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hello " * 50}]}
PACED = SimulatorConfig(api_key=KEY, ttft_ms=100, tokens_per_s=1000, rpm=0, itpm=0, otpm=0)
THINK_S = 0.05  # c=1: a harness's pause between calls
# what every shim here enforces, as in a real run: caps (never reached) and pool limits (never binding)
CAPS = {"limits": {"cost_usd": 1000.0, "max_turns": 10**6}, "run_cost_usd": 100_000.0}
POOL_LIMITS = {"rpm": 10**7, "itpm": 10**11, "otpm": 10**10}
RESULTS: list[tuple[str, str, bool]] = []


def verdict(name: str, value: str, ok: bool) -> None:
    RESULTS.append((name, value, ok))
    print(f"  {'PASS' if ok else 'MISS'}  {name}: {value}", flush=True)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


class MachineBusy:
    """How busy the machine's CPUs were between start and share() (/proc/stat): other sessions' load included."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # all but guest time; idle + iowait

    def share(self) -> float:
        total, idle = self._read()
        return 1 - (idle - self.start[1]) / max(1, total - self.start[0])


def _proc_stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


@functools.cache
def family(pid: int) -> list[int]:
    """`pid` and its descendants (LiteLLM's proxy may run its worker as a child), as they are when first asked."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(_proc_stat(int(stat.parent.name))[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_s(pid: int) -> float:
    ticks = sum(int(f[11]) + int(f[12]) for f in (_proc_stat(p) for p in family(pid)))
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    total = 0.0
    for p in family(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


@contextmanager
def shim_process(upstream: str, valkey_url: str, run: str, env_over: dict | None = None, key: str = KEY, **over):
    """`python -m shim` as the task runner starts it (harness/task.py), calling `upstream` with `key`: yields (URL,
    process, exec-to-ready s)."""
    r = redis.Redis.from_url(valkey_url)
    r.hset(keys.pool_limits(f"{run}-pool"), mapping=POOL_LIMITS)
    r.close()
    with tempfile.TemporaryDirectory() as d:
        cfg = ShimConfig(**{"upstream_url": upstream, "provider": "anthropic", "model": MODEL, "pool": f"{run}-pool",
                            "ref": {"run": run, "instance_id": "bench__bench-1", "attempt": 1}, "local_token": TOKEN,
                            "ledger_path": f"{d}/ledger.jsonl", "port_file": f"{d}/port", "valkey_url": valkey_url,
                            **CAPS, **over})
        env = {**{k: v for k, v in os.environ.items() if k != "SHIM_LOG_LEVEL"},
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_over or {})}
        # no start timeout, and a 1 ms poll: the time to ready is a figure of the bench
        shim = shim_service(cfg, Path(d, "shim.json"), key, log=Path(d, "shim.log"), env=env, cwd=ROOT,
                            timeout_s=None, poll_s=0.001, grace_s=30)
        t0 = time.perf_counter()
        with shim.start():
            yield f"http://127.0.0.1:{shim.port}", shim.proc, time.perf_counter() - t0


@contextmanager
def litellm_process(paced: str, instant: str):
    """The venv's LiteLLM proxy, DB-less, 1 worker, no retries: MODEL goes to the paced simulator, INSTANT to the
    instant one. Yields (URL, master key, process, exec-to-ready s)."""
    exe = os.environ.get("EVALPLANE_LITELLM") or shutil.which("litellm", path=str(Path(sys.executable).parent))
    if exe is None:
        raise SystemExit("bench_shim: no litellm executable in the venv (or $EVALPLANE_LITELLM)")
    with tempfile.TemporaryDirectory() as d:
        Path(d, "cfg.yaml").write_text(
            "model_list:\n" + "".join(
                f"  - model_name: {name}\n    litellm_params:\n      model: anthropic/{MODEL}\n"
                f"      api_base: {url}\n      api_key: os.environ/SIM_KEY\n" for name, url in ((MODEL, paced),
                                                                                          (INSTANT, instant)))
            + "litellm_settings:\n  num_retries: 0\n  request_timeout: 60\n"
            "general_settings:\n  master_key: os.environ/LITELLM_MASTER_KEY\n")
        master, port = "sk-" + secrets.token_hex(16), free_port()
        env = {**{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},  # DB-less
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": master, "SIM_KEY": KEY}
        base = f"http://127.0.0.1:{port}"
        litellm = Service([exe, "--config", f"{d}/cfg.yaml", "--port", str(port), "--num_workers", "1"],
                          name="litellm", env=env, log=Path(d, "litellm.log"), ready=lambda: _live(base),
                          timeout_s=300, poll_s=0.05, grace_s=30)
        t0 = time.perf_counter()
        with litellm.start():
            yield base, master, litellm.proc, time.perf_counter() - t0


def _live(base: str) -> bool:
    """LiteLLM's proxy answers its liveness route."""
    try:
        return httpx.get(f"{base}/health/liveliness", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def results_queue():
    """An SQS queue in moto's server mode, as a task's results queue: yields (queue URL, the shim's env)."""
    import boto3

    proc, endpoint = start_moto()
    try:
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL_SQS": endpoint}
        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                           aws_secret_access_key="bench")
        yield sqs.create_queue(QueueName="bench-results")["QueueUrl"], env
    finally:
        proc.kill()
        proc.wait()


Way = tuple[str, str, str, str, int | None]  # (name, base URL, key, the model the caller names, its process)


async def one(session: aiohttp.ClientSession, way: Way, stream: bool) -> tuple[float, ...]:
    """One call, end to end, in ms: (first byte, first content, last byte); a non-stream answer's first content
    is its last byte."""
    _, base, key, model, _ = way
    data = json.dumps({**BODY, "model": model, "stream": stream}).encode()
    t0 = time.perf_counter()
    async with session.post(base + "/v1/messages", data=data,
                            headers={"x-api-key": key, "Content-Type": "application/json"}) as r:
        first = time.perf_counter()
        assert r.status == 200, (r.status, await r.text())
        content = None
        async for chunk in r.content.iter_any():
            if content is None and b"content_block_delta" in chunk:
                content = time.perf_counter()
    end = time.perf_counter()
    return (first - t0) * 1000, ((content or end) - t0) * 1000, (end - t0) * 1000


async def latency(ways: list[Way], conc: int, rounds: int, per_caller: int = 2) -> dict:
    """conc=1: one caller per way, taking turns in an order rotated every turn, THINK_S apart, `rounds` calls
    each. Else, in `rounds` rounds, each way in turn (rotated every round) under `conc` closed-loop callers of its
    own, starting at random offsets within one call's time, `per_caller` calls each (so that one way's load is
    not another's: LiteLLM's would starve the machine). After a warm-up of `conc` calls at once each way.
    -> {(way, stream): [times]}"""
    out = {(w[0], s): [] for w in ways for s in (False, True)}
    rng = random.Random(1)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for stream in (False, True):
            period = (await one(session, ways[0], stream))[2] / 1000
            for w in ways:
                await asyncio.gather(*(one(session, w, stream) for _ in range(conc)))

            async def caller(w: Way, offset: float, n: int, stream: bool = stream) -> None:
                await asyncio.sleep(offset)
                for _ in range(n):
                    out[(w[0], stream)].append(await one(session, w, stream))
                    if conc == 1:
                        await asyncio.sleep(THINK_S)

            for i in range(rounds):
                for w in ways[i % len(ways):] + ways[:i % len(ways)]:
                    if conc == 1:
                        await caller(w, 0, 1)
                    else:
                        await asyncio.gather(*(caller(w, rng.uniform(0, period), per_caller) for _ in range(conc)))
                    await quiet(w[4])
    return out


async def quiet(pid: int | None, timeout_s: float = 10.0) -> None:
    """Wait until the process has finished what its calls left it to do (LiteLLM logs and prices its calls after
    answering them): the next way's calls are not measured against it."""
    deadline = time.monotonic() + timeout_s
    while pid is not None and time.monotonic() < deadline:
        c0 = cpu_s(pid)
        await asyncio.sleep(0.02)
        if cpu_s(pid) - c0 < 0.005:
            return


def report_latency(res: dict, conc: int) -> None:
    for stream, label in ((False, "non-stream"), (True, "stream")):
        points = ((0, "first byte"), (1, "1st content"), (2, "last byte")) if stream else ((2, "response"),)
        for i, what in points:
            d = [x[i] for x in res[("direct", stream)]]
            added = {}
            for way in ("shim", "litellm"):
                xs = [x[i] for x in res[(way, stream)]]
                added[way] = (pct(xs, 50) - pct(d, 50), pct(xs, 99) - pct(d, 99))
            (s50, s99), (l50, l99) = added["shim"], added["litellm"]
            print(f"    c={conc:<2} {label:10} {what:11} direct p50 {pct(d, 50):7.2f} p99 {pct(d, 99):7.2f} ms "
                  f"(n={len(d)}); added: shim p50 {s50:+6.2f} p99 {s99:+6.2f}, litellm p50 {l50:+6.2f} p99 {l99:+6.2f}")
            verdict(f"added latency c={conc} {label} {what}",
                    f"shim p50 {s50:+.2f} ms, p99 {s99:+.2f} ms; litellm p50 {l50:+.2f} ms, p99 {l99:+.2f} ms",
                    s50 <= 3.0 and s99 <= 10.0 and s50 < l50 and s99 < l99)


async def drive(way: Way, n: int, conc: int) -> None:
    sem = asyncio.Semaphore(conc)

    async def go(i: int) -> None:
        async with sem:
            await one(session, way, i % 2 == 1)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(go(i) for i in range(n)))
    await quiet(way[4])


def cpu_per_call(way: Way, pid: int, n: int) -> tuple[float, float]:
    """(CPU ms per call of `pid` and its children, calls/s) over `n` calls at concurrency 16, half streams."""
    c0, t0 = cpu_s(pid), time.perf_counter()
    asyncio.run(drive(way, n, 16))
    wall = time.perf_counter() - t0
    return (cpu_s(pid) - c0) / n * 1000, n / wall


def precompile() -> int:
    """Byte-compile what the shim loads, as a task image has it (pip compiles at install; this venv was made by uv,
    which does not, and PYTHONDONTWRITEBYTECODE may be set): else every start compiles ~300 modules."""
    code = ("import sys, py_compile, importlib.util, shim.__main__, shim.server, boto3, botocore.session; "
            "boto3.session.Session(region_name='us-east-1').client('sqs'); n = 0\n"
            "for m in list(sys.modules.values()):\n"
            "    f = getattr(m, '__file__', None) or ''\n"
            "    if f.endswith('.py') and not __import__('os').path.exists(importlib.util.cache_from_source(f)):\n"
            "        py_compile.compile(f, importlib.util.cache_from_source(f)); n += 1\n"
            "print(n)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def main() -> int:
    sections = ("latency", "cpu", "process")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--valkey", default=os.environ.get("VALKEY_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--quick", action="store_true", help="fewer calls (noisier)")
    ap.add_argument("--only", nargs="+", choices=sections, default=sections, metavar="SECTION",
                    help=f"run only these sections (of {', '.join(sections)})")
    args = ap.parse_args()
    run = "bench" + uuid.uuid4().hex[:8]
    print(f"bench_shim: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, python {sys.version.split()[0]}; "
          f"bytecode compiled for {precompile()} more modules the shim loads")
    try:
        with (simulator_process(PACED) as paced, simulator_process(SimulatorConfig(api_key=KEY, rpm=0, itpm=0,
                                                                                   otpm=0)) as instant,
              litellm_process(paced, instant) as (litellm, master, litellm_proc, litellm_ready)):
            print(f"  LiteLLM proxy ready in {litellm_ready:.1f} s (pid {litellm_proc.pid})")
            if "latency" in args.only:
                print(f"1. added latency (simulator: {PACED.ttft_ms:.0f} ms to first token, "
                      f"{PACED.tokens_per_s:.0f} tokens/s, {BODY['max_tokens']} tokens)")
                with shim_process(paced, args.valkey, run) as (via, shim_proc, _):
                    ways = [("direct", paced, KEY, MODEL, None), ("shim", via, TOKEN, MODEL, shim_proc.pid),
                            ("litellm", litellm, master, MODEL, litellm_proc.pid)]
                    for conc, rounds in ((1, 10 if args.quick else 100), (16, 2 if args.quick else 8)):
                        print("   c=1: one caller per way, the ways taking turns, 100 calls each" if conc == 1 else
                              f"   c={conc}: {rounds} rounds, in each the ways in turn, each under {conc} callers "
                              f"of its own making 2 calls back to back ({rounds * conc * 2} calls each way)")
                        busy = MachineBusy()
                        res = asyncio.run(latency(ways, conc, rounds))
                        print(f"    the machine's CPUs were {busy.share():.0%} busy meanwhile (load "
                              f"{os.getloadavg()[0]:.2f})")
                        report_latency(res, conc)
            if "cpu" in args.only or "process" in args.only:
                n = 400 if args.quick else 2000
                print(f"2. CPU per call (instant simulator, concurrency 16, half streams, {n} calls; the shim sends "
                      "its ledger rows to a results queue, SQS in moto's server mode)")
                with (results_queue() as (queue_url, aws_env),
                      shim_process(instant, args.valkey, run, env_over=aws_env, results_queue_url=queue_url)
                      as (via, proc, _)):
                    shim_way = ("shim", via, TOKEN, MODEL, proc.pid)
                    litellm_way = ("litellm", litellm, master, INSTANT, litellm_proc.pid)
                    asyncio.run(drive(shim_way, 100, 16))  # warm-up
                    pers = []
                    for _ in range(3):
                        per, rate = cpu_per_call(shim_way, proc.pid, n)
                        pers.append(per)
                        print(f"    shim: {per:.3f} ms CPU per call ({rate:.0f} calls/s)")
                    ll_per, ll_rate = cpu_per_call(litellm_way, litellm_proc.pid, n // 4)
                    print(f"    litellm, on {n // 4} of the same calls: {ll_per:.3f} ms CPU per call ({ll_rate:.0f} "
                          f"calls/s)")
                    verdict("shim CPU per call (median of 3 rounds)", f"{statistics.median(pers):.3f} ms "
                            f"(litellm {ll_per:.3f} ms)", statistics.median(pers) <= 1.0)
                    rss = rss_mb(proc.pid)
                verdict("shim RSS after the CPU run (results queue client loaded)",
                        f"{rss:.1f} MB (litellm {rss_mb(litellm_proc.pid):.1f} MB)", rss <= 120)
                readies = []
                for _ in range(3):
                    with shim_process("http://127.0.0.1:9", args.valkey, run) as (_, _, ready):
                        readies.append(ready)
                verdict("shim exec to ready (median of 3)", f"{statistics.median(readies) * 1000:.0f} ms "
                        f"(litellm {litellm_ready * 1000:.0f} ms)", statistics.median(readies) <= 1.5)
    finally:
        forget_run(args.valkey, run)
    summary()
    return 0


def forget_run(valkey_url: str, run: str) -> None:
    """Delete the Valkey keys the bench's run left (its pool's limits, budgets, progress)."""
    r = redis.Redis.from_url(valkey_url)
    found = list(r.scan_iter(match=f"*{run}*", count=1000))
    if found:
        r.delete(*found)
    r.close()


def summary() -> None:
    missed = [n for n, _, ok in RESULTS if not ok]
    print(f"summary: {len(RESULTS) - len(missed)} PASS, {len(missed)} MISS" + (f" ({'; '.join(missed)})" if missed else ""))


if __name__ == "__main__":
    sys.exit(main())
