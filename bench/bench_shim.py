"""The shim's cost, measured side by side in one run against the simulator and the real Valkey.

    .venv/bin/python bench/bench_shim.py [--quick] [--valkey redis://127.0.0.1:6379/0]

Every shim here has an attempt cap, a run cap and pool limits set (none of them binding), so each call takes
and settles real holds and books the pool's rpm/itpm/otpm.

Prints, with a PASS/MISS per target (issue 3):
  1. added latency (via shim - direct, each as its time outside the simulator: see one(); end to end beside),
     simulator at a model's pace (300 ms to first token, 50 tokens/s), non-streaming and streams (first byte:
     the head; first content event; last byte), concurrency 1 and 64: p50 <= 0.5 ms, p99 <= 3 ms;
  2. the shim process's CPU time per call against an instant simulator (pacer, caps, metering, ledger, progress
     included; ledger rows sent to a results queue, SQS in moto's server mode, as in a task): <= 0.3 ms; beside
     it, a bare TCP relay's CPU per call on the same calls (a yardstick: these VMs differ by ~2x in speed from
     one session to the next), and, informational, what that CPU per call alone costs in latency here (c=64, a
     relay spinning the shim's extra CPU after each answer);
  3. pacer admissions/s as a ratio to the same Valkey's no-op EVALSHA rate: >= 0.5;
  4. the shim's RSS (<= 50 MB) and its time from exec to ready-to-serve (<= 0.5 s).

c=1 long prompt: a pinning relay beside the bare one (bench/tcp_relay.py --pin) shows what parsing the body and
pinning its model cost any proxy.

--compiled: the same relays compiled (bench/compiled_relay, built by scripts/build_compiled_relay.sh if it is not
built yet) run beside the Python ones in the c=1 workloads, as more ways in: how much of a floor is the
interpreter, i.e. what a compiled shim could reach on this machine; with them a prototype of the shim's path compiled
(compiled_relay --dataplane: token, pinning, forwarding, the stream held until its first content, usage read, a
record written; no tickets, no control plane). The c=1 workloads take ~2/3 longer, the long prompt's twice as long;
not at c=64, where 64 more callers each would load the machine more than a run without them. The pinning relay
compiled uses its own JSON scanner (bench/compiled_relay/src/scan.rs; --pin, with serde_json, is slower).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import aiohttp
import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moto_proc import start_moto

from contract import keys
from shim.pacer import PaceRequest, ValkeyPacer
from simulator import SimulatorConfig
from simulator.testing import simulator_process

KEY = "sk-bench-" + uuid.uuid4().hex
TOKEN = "bench-local-token"
DATAPLANE = "compiled"  # ShimConfig.dataplane of every shim here (--dataplane)
BODY = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hello " * 50}]}
RESULTS: list[tuple[str, str, bool]] = []


def verdict(name: str, value: str, ok: bool) -> None:
    RESULTS.append((name, value, ok))
    print(f"  {'PASS' if ok else 'MISS'}  {name}: {value}", flush=True)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# what every shim here enforces, as in a real run: an attempt cap and a run cap (never reached) and pool limits
# (never binding), so that each call takes and settles real holds and books the pool's three GCRA dimensions
CAPS = {"limits": {"cost_usd": 1000.0, "max_turns": 10**6}, "run_cost_usd": 100_000.0}
POOL_LIMITS = {"rpm": 10**7, "itpm": 10**11, "otpm": 10**10}


@contextmanager
def shim_process(upstream: str, valkey_url: str, run: str, env_over: dict | None = None, **over):
    if valkey_url:
        r = redis.Redis.from_url(valkey_url)
        r.hset(keys.pool_limits(f"{run}-pool"), mapping=POOL_LIMITS)
        r.close()
    with tempfile.TemporaryDirectory() as d:
        cfg = {"upstream_url": upstream, "provider": "anthropic", "model": "claude-sonnet-4-5", "pool": f"{run}-pool",
               "ref": {"run": run, "instance_id": "bench__bench-1", "attempt": 1}, "local_token": TOKEN,
               "ledger_path": f"{d}/ledger.jsonl", "port_file": f"{d}/port", "valkey_url": valkey_url, **CAPS,
               "dataplane": DATAPLANE, **over}
        Path(d, "shim.json").write_text(json.dumps(cfg))
        # as the task runner starts it (harness/task.py): its default log level, its output to a file
        env = {**{k: v for k, v in os.environ.items() if k != "SHIM_LOG_LEVEL"}, "SHIM_UPSTREAM_KEY": KEY,
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_over or {})}
        log = open(f"{d}/shim.log", "ab")  # noqa: SIM115 - closed below, after the process
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "shim", "--config", f"{d}/shim.json"], cwd=ROOT, env=env,
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        port_file = Path(d, "port")
        while not port_file.exists():
            if proc.poll() is not None:
                log.close()
                raise RuntimeError("shim exited: " + Path(d, "shim.log").read_text()[-2000:])
            time.sleep(0.001)
        ready = time.perf_counter() - t0
        try:
            yield f"http://127.0.0.1:{port_file.read_text()}", proc, ready
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def family(pid: int) -> list[int]:
    """`pid` and its children (the shim and, with the compiled data plane, its shim_dataplane process)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return [pid, *kids]


def cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its children (those still running: the shim's data plane is)."""
    total = 0
    for p in family(pid):
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class MachineBusy:
    """How busy the machine's CPUs were between start and stop (/proc/stat: 1 - idle share): a workload that
    keeps the machine busy measures queueing for a CPU as much as the shim, and the report says so."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # all but guest time; idle + iowait

    def share(self) -> float:
        total, idle = self._read()
        return 1 - (idle - self.start[1]) / max(1, total - self.start[0])


def rss_mb(pid: int) -> float:
    """RSS of `pid` and its children, summed."""
    total = 0.0
    for p in family(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def long_body() -> dict:
    """A prompt as a harness sends it some turns into a task: ~140 KB of conversation."""
    turn = "some text with code `def f(x): return x` and its output lines\n" * 40
    return {**BODY, "messages": [{"role": ("user", "assistant")[i % 2], "content": turn} for i in range(60)]}


@contextmanager
def _listening(cmd: list[str], env: dict | None = None):
    """A relay process that prints the port it listens on: yields (its URL, its pid); kills it after."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield f"http://127.0.0.1:{proc.stdout.readline().strip()}", proc.pid
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def relay_process(upstream: str, with_pid: bool = False, burn_us: float = 0.0, pin: str | None = None):
    """bench/tcp_relay.py in front of `upstream`: the floor for one more process on the path. Yields its URL (and
    its pid: `with_pid`). `burn_us`: CPU it spins after passing on each response head; `pin`: a pinning relay,
    which parses each request's body and pins its model (see tcp_relay.py)."""
    u = urlparse(upstream)
    with _listening([sys.executable, str(ROOT / "bench" / "tcp_relay.py"), u.hostname, str(u.port),
                     *([f"{burn_us:.0f}"] if burn_us else []), *(["--pin", pin] if pin else [])]) as (url, pid):
        yield (url, pid) if with_pid else url


@contextmanager
def compiled_process(binary: str, upstream: str, *mode: str):
    """bench/compiled_relay's `binary` in front of `upstream`; `mode`: none (a bare relay), ("--scan-pin", MODEL)
    or ("--dataplane",): the data plane prototype, pinned to BODY's model, taking TOKEN, sending KEY, writing its
    call records to a temporary file. Yields its URL."""
    u = urlparse(upstream)
    cmd, env = [binary, u.hostname, str(u.port), *mode], None
    with tempfile.TemporaryDirectory(prefix="bench-dataplane-") as tmp:
        if mode == ("--dataplane",):
            cmd += [BODY["model"], TOKEN]
            env = {**os.environ, "DATAPLANE_UPSTREAM_KEY": KEY, "DATAPLANE_RECORDS": os.path.join(tmp, "records.jsonl")}
        with _listening(cmd, env) as (url, _):
            yield url


@contextmanager
def results_queue():
    """An SQS queue in moto's server mode (a subprocess), as a task's results queue: yields (queue URL, the
    environment a shim needs to send to it)."""
    import boto3

    proc, endpoint = start_moto()
    try:
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL_SQS": endpoint}
        sqs = boto3.client("sqs", endpoint_url=env["AWS_ENDPOINT_URL_SQS"], region_name="us-east-1",
                           aws_access_key_id="bench", aws_secret_access_key="bench")
        yield sqs.create_queue(QueueName="bench-results")["QueueUrl"], env
    finally:
        proc.kill()
        proc.wait()


_SENT = re.compile(rb": sent=([0-9.]+)")
THINK_S = 0.05  # c=1: a harness's pause between calls (a real one runs a command; seconds)


class Times(NamedTuple):
    """One call, in ms: its time outside the simulator up to each point (see one()), then end to end."""

    first: float  # the response head
    last: float  # the last byte
    content: float  # the first content byte (a non-stream answer: its last byte)
    e2e_first: float
    e2e_last: float
    e2e_content: float


async def one(session: aiohttp.ClientSession, url: str, headers: dict, stream: bool,
              body: dict | None = None) -> Times:
    """A call's time outside the simulator up to its first byte, last byte and first content byte: from the
    request's start to its arrival at the simulator, plus from the simulator's sending of that part to the
    client having it (SimulatorConfig.report_timing; time.perf_counter is the machine's monotonic clock in
    every process). Then the same three end to end, as the client saw them.

    Why outside the simulator: the simulator's own time for the same call moves with what else runs (its
    timers wake on whole milliseconds; measured side by side, its time for direct calls moved by ~0.5 ms
    against shim calls when the calls were spaced out), and that is the simulator's, not the shim's."""
    data = json.dumps({**(body or BODY), "stream": stream}).encode()
    t0 = time.perf_counter()
    async with session.post(url, data=data, headers={**headers, "Content-Type": "application/json"}) as r:
        first = time.perf_counter()
        assert r.status == 200, r.status
        # (an instant simulator without report_timing: the time outside it is taken as the whole call's)
        arrived = float(r.headers.get("x-simulator-arrived", t0))
        head_sent = float(r.headers.get("x-simulator-sent", first))
        content = content_sent = None
        last_sent = head_sent
        async for chunk in r.content.iter_any():
            i = chunk.find(b"content_block_delta") if content is None else -1
            if i >= 0:
                content = time.perf_counter()
                before = _SENT.findall(chunk, 0, i)
                content_sent = float(before[-1]) if before else last_sent
            if b": sent=" in chunk:
                last_sent = float(_SENT.findall(chunk)[-1])
    end = time.perf_counter()
    to_sim = arrived - t0
    e2e = ((first - t0) * 1000, (end - t0) * 1000, ((content or end) - t0) * 1000)
    if content is None:  # a non-stream answer: its head and body came at once
        content, content_sent = end, last_sent
    return Times((to_sim + first - head_sent) * 1000, (to_sim + end - last_sent) * 1000,
                 (to_sim + content - content_sent) * 1000, *e2e)


async def latency_lockstep(direct: str, via: str, conc: int, rounds: int) -> dict:
    """Informational: `conc` calls fired in the same millisecond, direct and shim waves alternating."""
    hd = {"x-api-key": KEY}
    hs = {"x-api-key": TOKEN}
    out = {(m, s): [] for m in ("direct", "shim") for s in (False, True)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for stream in (False, True):  # warm connections
            await asyncio.gather(*(one(session, direct + "/v1/messages", hd, stream) for _ in range(conc)),
                                 *(one(session, via + "/v1/messages", hs, stream) for _ in range(conc)))
        for _ in range(rounds):
            for stream in (False, True):
                for mode, base, h in (("direct", direct, hd), ("shim", via, hs)):
                    out[(mode, stream)] += await asyncio.gather(
                        *(one(session, base + "/v1/messages", h, stream) for _ in range(conc)))
    return out


# the ways in besides direct and the shim: what each one's report line says it is
WAYS = {
    "relay": "floor, a bare TCP relay (bench/tcp_relay.py) on the same path",
    "compiled": "floor, the same relay compiled (bench/compiled_relay)",
    "pinning": "floor for parsing and pinning the body, a pinning relay (tcp_relay.py --pin)",
    "compiled scan pinning": "floor for parsing and pinning the body, compiled (compiled_relay --scan-pin)",
    "dataplane": "the shim's path compiled, a prototype without tickets or control plane (compiled_relay --dataplane)",
    "python shim": "beside it, the shim with its Python data plane (dataplane: python)",
}


async def latency_closed(direct: str, via: str, relay: str, conc: int, calls: int, seed: int = 1,
                         body: dict | None = None, streams: tuple[bool, ...] = (False, True),
                         more: dict[str, str] | None = None) -> dict:
    """`conc` closed-loop callers through the shim, `conc` through the bare relay and `conc` calling the
    simulator directly, all running at the same time (so noise hits all three); each caller starts at a random
    offset within one call's duration, then makes `calls` calls back to back. conc=1: one caller of each,
    taking turns in a rotating order. `body`: the request (the shim's callers name a model alias, which the
    shim rewrites). `more`: more ways in, {name in WAYS: URL}; a pinning relay (relay_process(pin=...)) and the data
    plane prototype are sent the shim's body (they pin the model as the shim does), the latter with its token."""
    direct_body = body
    shim_body = None if body is None else {**body, "model": "anthropic/" + body["model"]}
    modes = (("direct", direct, {"x-api-key": KEY}, direct_body), ("relay", relay, {"x-api-key": KEY}, direct_body),
             ("shim", via, {"x-api-key": TOKEN}, shim_body))
    for name, url in (more or {}).items():
        as_shim = "pinning" in name or name in ("dataplane", "python shim")
        modes += ((name, url, {"x-api-key": TOKEN if name in ("dataplane", "python shim") else KEY},
                   shim_body if as_shim else direct_body),)
    rng = random.Random(seed)
    out = {(m[0], s): [] for m in modes for s in streams}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for stream in streams:
            # one call's duration, end to end (callers start at random offsets within it)
            period = (await one(session, direct + "/v1/messages", modes[0][2], stream, body)).e2e_last / 1000
            # warm-up, not measured: `conc` calls at once each way, so that every path has its connections
            # (the harness's to the shim and the simulator, the shim's to the simulator) before measuring
            await asyncio.gather(*(one(session, base + "/v1/messages", h, stream, b)
                                   for _, base, h, b in modes for _ in range(conc)))
            if conc == 1:
                # they take turns, in an order rotated every turn: a call's place in the turn moves its latency
                # by ~0.1 ms (A/B runs of two shims in swapped places showed the last place favoured)
                for i in range(calls):
                    for mode, base, h, b in modes[i % len(modes):] + modes[:i % len(modes)]:
                        out[(mode, stream)].append(await one(session, base + "/v1/messages", h, stream, b))
                        await asyncio.sleep(THINK_S)
                continue

            async def caller(mode: str, base: str, h: dict, b: dict | None, offset: float,
                             stream: bool = stream) -> None:
                await asyncio.sleep(offset)
                for _ in range(calls):
                    out[(mode, stream)].append(await one(session, base + "/v1/messages", h, stream, b))

            await asyncio.gather(*(caller(mode, base, h, b, rng.uniform(0, period))
                                   for _ in range(conc) for mode, base, h, b in modes))
    return out


def report_latency(res: dict, conc: int, informational: bool = False, tag: str = "") -> None:
    for stream, label in ((False, "non-stream"), (True, "stream")):
        if ("shim", stream) not in res:
            continue
        # a stream: its head (the first byte), its first content event (what the harness waits for: the shim
        # holds the events before it back, so that errors before it can be retried unseen) and its last byte
        rows = (("first", "first byte"), ("content", "1st content"), ("last", "last byte")) if stream \
            else (("last", "response"),)
        for point, what in rows:
            d = [getattr(x, point) for x in res[("direct", stream)]]
            s = [getattr(x, point) for x in res[("shim", stream)]]
            p50 = pct(s, 50) - pct(d, 50)
            p99 = pct(s, 99) - pct(d, 99)
            d_raw = [getattr(x, "e2e_" + point) for x in res[("direct", stream)]]
            s_raw = [getattr(x, "e2e_" + point) for x in res[("shim", stream)]]
            print(f"    c={conc:<3} {label:10} {what:10}  outside the simulator: direct p50 {pct(d, 50):6.2f} p99 "
                  f"{pct(d, 99):6.2f} | shim p50 {pct(s, 50):6.2f} p99 {pct(s, 99):6.2f} ms (n={len(s)}); end to "
                  f"end: shim - direct p50 {pct(s_raw, 50) - pct(d_raw, 50):+.2f}, "
                  f"p99 {pct(s_raw, 99) - pct(d_raw, 99):+.2f}")
            for name, way in WAYS.items():
                if (name, stream) in res:
                    r = [getattr(x, point) for x in res[(name, stream)]]
                    print(f"    {'':16}{what:10}  {way}: p50 {pct(r, 50) - pct(d, 50):+.2f} ms, "
                          f"p99 {pct(r, 99) - pct(d, 99):+.2f} ms")
            if informational:
                print(f"  info  lockstep burst c={conc} {label} {what}: p50 {p50:+.2f} ms, p99 {p99:+.2f} ms")
                continue
            verdict(f"added latency c={conc}{tag} {label} {what}", f"p50 {p50:+.2f} ms, p99 {p99:+.2f} ms",
                    p50 <= 0.5 and p99 <= 3.0)


async def drive(via: str, n: int, conc: int, key: str = TOKEN) -> None:
    hs = {"x-api-key": key}
    sem = asyncio.Semaphore(conc)

    async def go(i: int):
        async with sem:
            await one(session, via + "/v1/messages", hs, i % 2 == 1)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(go(i) for i in range(n)))


async def pacer_rate(valkey_url: str, pool: str, seconds: float, conc: int = 64) -> tuple[float, float]:
    r = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(valkey_url, max_connections=conc))
    await r.hset(keys.pool_limits(pool), mapping={"rpm": 10**9, "itpm": 10**12, "otpm": 10**12})
    pacer = ValkeyPacer(r, pool, burst_s=60)
    noop = r.register_script("return 1")
    req = PaceRequest(pool, 1000, 500)

    async def loop(fn, stop: float, count: list[int]):
        while time.perf_counter() < stop:
            await fn()
            count[0] += 1

    async def rate(fn) -> float:
        count = [0]
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(fn, t0 + seconds, count) for _ in range(conc)))
        return count[0] / (time.perf_counter() - t0)

    await pacer.admit(req)
    await noop(keys=[keys.pool_pacer(pool)])
    rates = {"pacer": [], "noop": []}
    for _ in range(2):  # interleaved, so drift hits both
        rates["noop"].append(await rate(lambda: noop(keys=[keys.pool_pacer(pool)])))
        rates["pacer"].append(await rate(lambda: pacer.admit(req)))
    await r.delete(keys.pool_limits(pool), keys.pool_pacer(pool))
    await r.aclose()
    return statistics.mean(rates["pacer"]), statistics.mean(rates["noop"])


_seen = {"calls": 0, "used": 0, "asks": 0}


def print_paths(via: str) -> None:
    """How many of the shim's calls since the last report went on a ticket (with the compiled data plane: the
    calls it served itself; the others went to the Python shim)."""
    st = json.loads(urllib.request.urlopen(f"{via}/_shim/status", timeout=10).read())
    compiled = st.get("dataplane") == "compiled"
    n = st["dataplane_calls"] if compiled else st["tickets"].get("used", 0)
    calls, used = st["calls"] - _seen["calls"], n - _seen["used"]
    _seen.update(calls=st["calls"], used=n)
    where = "served by the compiled data plane" if compiled else "on a ticket"
    asks = st.get("dataplane_asks", 0) - _seen.get("asks", 0)
    _seen["asks"] = st.get("dataplane_asks", 0)
    print(f"    the shim's calls {where}: {used} of {calls}" + (f" ({asks} on a ticket it asked for)" if compiled else ""))


def cleanup(valkey_url: str, run: str) -> None:
    r = redis.Redis.from_url(valkey_url)
    found = list(r.scan_iter(match=f"*{run}*", count=1000))
    if found:
        r.delete(*found)
    r.close()


SECTIONS = ("latency", "cpu", "pacer", "process")
# the realistic model pace of section 1 (and of section 2's informational latency run)
PACED = SimulatorConfig(api_key=KEY, ttft_ms=300, tokens_per_s=50, rpm=0, itpm=0, otpm=0, report_timing=True)


def bench_latency(args, run: str, compiled: str | None) -> None:
    """1. added latency per call, against calling the simulator directly."""
    print("1. added latency (simulator: 300 ms to first token, 50 tokens/s)")
    with (simulator_process(PACED) as sim, shim_process(sim, args.valkey, run) as (via, proc, _),
          relay_process(sim) as relay, ExitStack() as stack):
        # the compiled ways join the c=1 workloads only: at c=64 their callers would load the machine more than
        # the runs without them (and move the shim's rows)
        more = {name: stack.enter_context(compiled_process(compiled, sim, *mode))
                for name, mode in (("compiled", ()), ("dataplane", ("--dataplane",)))} if compiled else {}
        if DATAPLANE == "compiled":  # the Python data plane beside it (c=1 only, as the compiled relays)
            more["python shim"] = stack.enter_context(
                shim_process(sim, args.valkey, run + "py", dataplane="python"))[0]
        # c=1: 100 calls each, so that its p99 is a p99 (of 30, as until 2026-11-30, it was the slowest call: one
        # stall of the VM in any of the three decided the row)
        for conc, calls in ((1, 8 if args.quick else 100), (64, 2 if args.quick else 12)):
            if conc == 1:
                print(f"   workload c=1: one caller direct, one via the bare relay, one via the shim"
                      f"{', one via the compiled relay, one via the compiled data plane' if compiled else ''}"
                      f"{', one via the shim with its Python data plane' if DATAPLANE == 'compiled' else ''}, "
                      f"taking turns in a rotating order, "
                      f"{calls} calls each, {THINK_S * 1000:.0f} ms apart")
            else:
                print(f"   workload c={conc}: {conc} closed-loop callers via the shim, {conc} via the bare relay "
                      f"and {conc} direct, running side by side, random start offsets within one call, {calls} "
                      f"calls each (after a warm-up of {conc} calls at once each way)")
            busy = MachineBusy()
            res = asyncio.run(latency_closed(sim, via, relay, conc, calls, more=more if conc == 1 else None))
            print(f"    the machine's CPUs were {busy.share():.0%} busy during this workload")
            report_latency(res, conc)
            print_paths(via)
        calls = 8 if args.quick else 60
        three = "; three more: the bare relay compiled, the pinning one compiled, the compiled data plane"
        print(f"   workload c=1, long prompt: as c=1, with a {len(json.dumps(long_body())) // 1024} KB prompt "
              f"naming a model alias (the shim parses it, pins the model and serialises it again), "
              f"non-stream, {calls} calls each; a fourth caller goes via a pinning relay, which does only that"
              f"{three if compiled else ''}")
        # a new shim (and Python shim beside it): the c=64 workload left up to 64 tickets sized for short prompts,
        # each of which a long prompt's call would give back and ask for itself (until 2026-11-30 every call
        # here did: the row carried a Valkey round trip that a harness growing its prompt does not pay)
        with (relay_process(sim, pin=BODY["model"]) as pinning,
              shim_process(sim, args.valkey, run + "lp") as (via_lp, _, _)):
            if compiled:
                more["compiled scan pinning"] = stack.enter_context(
                    compiled_process(compiled, sim, "--scan-pin", BODY["model"]))
            if "python shim" in more:
                more["python shim"] = stack.enter_context(
                    shim_process(sim, args.valkey, run + "lppy", dataplane="python"))[0]
            report_latency(asyncio.run(latency_closed(sim, via_lp, relay, 1, calls, body=long_body(),
                                                      streams=(False,), more={"pinning": pinning, **more})),
                           1, tag=" long prompt")
            _seen.update(calls=0, used=0, asks=0)
            print_paths(via_lp)
        print("   informational, not a target: c=64 lockstep bursts (64 calls in the same millisecond, "
              "direct and shim waves alternating)")
        report_latency(asyncio.run(latency_lockstep(sim, via, 64, 1 if args.quick else 2)), 64, True)


def bench_cpu(args, run: str) -> float:
    """2. the shim's CPU per call against an instant simulator, beside a bare relay's; returns its RSS after."""
    print("2. shim CPU per call (instant simulator; half streams; concurrency 16; ledger rows sent to a results "
          "queue, SQS in moto's server mode, as in a task), beside a bare TCP relay's on the same calls (what "
          "any process on the path costs on this machine: a yardstick across machines)")
    instant = SimulatorConfig(api_key=KEY, rpm=0, itpm=0, otpm=0)
    n = 600 if args.quick else 2000
    with (results_queue() as (queue_url, aws_env), simulator_process(instant) as sim,
          shim_process(sim, args.valkey, run, env_over=aws_env, results_queue_url=queue_url) as (via, proc, _),
          relay_process(sim, with_pid=True) as (relay, relay_pid)):
        asyncio.run(drive(via, 100, 16))  # warm up
        asyncio.run(drive(relay, 100, 16, KEY))
        pers, floors = [], []
        for _ in range(5):  # the median of five rounds (one round moves by up to +-0.1 ms on a noisy VM)
            c0, t0 = cpu_s(proc.pid), time.perf_counter()
            asyncio.run(drive(via, n, 16))
            used, wall = cpu_s(proc.pid) - c0, time.perf_counter() - t0
            pers.append(used / n * 1000)
            c0 = cpu_s(relay_pid)
            asyncio.run(drive(relay, n, 16, KEY))
            floors.append((cpu_s(relay_pid) - c0) / n * 1000)
            print(f"    {n} calls in {wall:.2f} s ({n / wall:.0f}/s), shim CPU {used:.2f} s; the relay's on the "
                  f"same calls {floors[-1] * n / 1000:.2f} s")
        per, floor = statistics.median(pers), statistics.median(floors)
        print(f"    bare relay CPU per call (median of 5 rounds): {floor:.3f} ms; the shim's is "
              f"{per / floor:.1f}x it")
        verdict("shim CPU per call (median of 5 rounds)", f"{per:.3f} ms", per <= 0.3)
        rss = rss_mb(proc.pid)

    burn = max(0.0, per - floor) * 1000
    print(f"   informational, not a target: what CPU per call alone costs in latency here. c=64 non-stream, side "
          f"by side: direct, via the shim, and via the bare relay spinning {burn:.0f} us of CPU after each answer "
          f"(the shim's CPU per call less the relay's, above)")
    with (simulator_process(PACED) as sim, shim_process(sim, args.valkey, run) as (via, proc, _),
          relay_process(sim, burn_us=burn) as burner):
        res = asyncio.run(latency_closed(sim, via, burner, 64, 2 if args.quick else 12, streams=(False,)))
        d, sh, r = ([x.last for x in res[(m, False)]] for m in ("direct", "shim", "relay"))
        print(f"  info  c=64 non-stream response, p50 over direct: via the shim {pct(sh, 50) - pct(d, 50):+.2f} "
              f"ms, via the relay spinning {burn:.0f} us {pct(r, 50) - pct(d, 50):+.2f} ms")
    return rss


def bench_pacer(args, run: str) -> None:
    """3. pacer admissions per second against a no-op EVALSHA."""
    print("3. pacer admissions/s vs no-op EVALSHA (same Valkey, same client, 64 concurrent)")
    p, noop = asyncio.run(pacer_rate(args.valkey, f"{run}-pool", 1.0 if args.quick else 2.0))
    verdict("pacer admissions / no-op EVALSHA", f"{p:.0f}/s vs {noop:.0f}/s = {p / noop:.2f}", p / noop >= 0.5)


def bench_process(args, run: str, rss: float | None) -> None:
    """4. the shim process: RSS (after the CPU run, if it ran) and time to ready."""
    print("4. the shim process")
    readies = []
    for _ in range(3):
        with shim_process("http://127.0.0.1:9", args.valkey, run) as (_, proc, ready):
            readies.append(ready)
    if rss is not None:
        verdict("RSS after the CPU run", f"{rss:.1f} MB", rss <= 50)
    # in a task the shim always has a results queue: its SQS sender (shim/sqs.py) is loaded and has its
    # credentials (from the environment here) once it is ready
    with shim_process("http://127.0.0.1:9", args.valkey, run,
                      results_queue_url="http://127.0.0.1:9/000000000000/bench-never",
                      env_over={"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                                "AWS_REGION": "us-east-1"}) as (_, proc, _):
        time.sleep(3)
        rss_q = rss_mb(proc.pid)
    verdict("RSS with a results queue configured (SQS client loaded, idle)", f"{rss_q:.1f} MB", rss_q <= 50)
    verdict("exec to ready-to-serve (median of 3)", f"{statistics.median(readies) * 1000:.0f} ms",
            statistics.median(readies) <= 0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--valkey", default=os.environ.get("VALKEY_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    ap.add_argument("--compiled", action="store_true",
                    help="run the relays compiled too (bench/compiled_relay), beside the Python ones")
    ap.add_argument("--dataplane", choices=("compiled", "python"), default="compiled",
                    help="the shim's data plane (ShimConfig.dataplane; compiled: built first if needed)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, metavar="SECTION",
                    help=f"run only these sections (of {', '.join(SECTIONS)}); all by default")
    args = ap.parse_args()
    global DATAPLANE
    DATAPLANE = args.dataplane
    if DATAPLANE == "compiled":
        subprocess.run(["bash", str(ROOT / "scripts" / "build_dataplane.sh")], check=True, stdout=subprocess.DEVNULL)
    compiled = None
    if args.compiled:  # built first: a build is not timed with the workloads
        compiled = subprocess.run(["bash", str(ROOT / "scripts" / "build_compiled_relay.sh")], check=True,
                                  stdout=subprocess.PIPE, text=True).stdout.strip()
    run = "bench" + uuid.uuid4().hex[:8]
    print(f"bench_shim: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, python {sys.version.split()[0]}, "
          f"the shim's data plane: {DATAPLANE} (its CPU and RSS: the shim's process and its child summed)")
    try:
        if "latency" in args.only:
            bench_latency(args, run, compiled)
        rss = bench_cpu(args, run) if "cpu" in args.only else None
        if "pacer" in args.only:
            bench_pacer(args, run)
        if "process" in args.only:
            bench_process(args, run, rss)
    finally:
        cleanup(args.valkey, run)
    missed = [n for n, _, ok in RESULTS if not ok]
    print(f"summary: {len(RESULTS) - len(missed)} PASS, {len(missed)} MISS"
          + (f" ({'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
