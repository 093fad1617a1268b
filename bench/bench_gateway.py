"""The gateway tier's cost beside the shim's, measured side by side in one run against the provider simulator:
the real tier (gateway/tier.py: LiteLLM replicas with this project's plugin behind haproxy), the real shim, a
database of the bench's own in PostgreSQL and the real Valkey.

    .venv/bin/python bench/bench_gateway.py [--quick] [--only capacity latency]

Needs DATABASE_URL (a server where the bench may create and drop a database), VALKEY_URL and haproxy, as after
`eval "$(scripts/stack.sh up | sed 's/^/export /')"`. Prints, with a PASS/MISS per target (issue 34, item 9):
  1. capacity: one replica against an instant simulator, 16 callers in a closed loop, half streams: calls per
     second and CPU per call (the replica's, the shim's beside it). The calls per second are the figure `plan`
     sizes the tier from ([gateway] replica_calls_per_s).
  2. latency: the tier at the replicas the planner sizes (dispatcher.driver.fleet.gateway_replicas) for 64
     callers making agent-shaped calls (3 s to the first token, then 25 tokens a second), four ways side by
     side: direct, through the shim, through the gateway, through the shim and the gateway (a task's path). Added
     latency over direct at concurrency 1 (the ways taking turns) and 64 (each way in turn under 64 callers of its
     own): shim and gateway together p50 <= 15 ms at 64.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_shim as bs

from contract import db
from dispatcher.driver.fleet import GATEWAY_UTILISATION, gateway_replicas
from dispatcher.spec import GatewaySpec
from gateway import aliases, keyfile, keys, tier
from plumbing.services import recorded_pid
from simulator import SimulatorConfig
from simulator.testing import simulator_process

MODEL, KEY, TOKEN = bs.MODEL, bs.KEY, bs.TOKEN
# An agent's call: a frontier model on an agent's long context takes seconds to its first token, then writes tens
# of tokens a second
AGENT = SimulatorConfig(api_key=KEY, ttft_ms=3000, tokens_per_s=25, rpm=0, itpm=0, otpm=0)
INSTANT = SimulatorConfig(api_key=KEY, rpm=0, itpm=0, otpm=0)
CALLERS = 64
TARGET_MS = 15.0


@contextmanager
def bench_database():
    """A migrated database of the bench's own on DATABASE_URL's server, dropped after: yields its URL."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    base = os.environ.get("DATABASE_URL")
    if not base:
        raise SystemExit("bench_gateway: DATABASE_URL is not set (scripts/stack.sh up prints it)")
    name = f"ep_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = make_conninfo(**{**conninfo_to_dict(base), "dbname": name})
    try:
        with psycopg.connect(url) as conn:
            db.migrate(conn)
        yield url
    finally:
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def gateway_tier(database_url: str, valkey_url: str, replicas: int, upstreams: dict[str, str], owner: str):
    """The tier with `replicas` replicas in a state folder of its own, an alias per upstream (name -> simulator URL)
    and a key for them all: yields (tier info, key, {name: alias}, replica pids)."""
    with tempfile.TemporaryDirectory() as d:
        state = Path(d)
        try:
            info = tier.ensure(state, database_url, valkey_url, replicas)
            keyfile.put(tier.provider_keys_file(state), "bench-sim", KEY)
            names = {name: f"{MODEL}@{owner}-{name}" for name in upstreams}
            key = "sk-bench-gw-" + uuid.uuid4().hex
            valkey = redis.Redis.from_url(valkey_url)
            with psycopg.connect(database_url, autocommit=True) as conn:
                for name, url in upstreams.items():
                    aliases.register(conn, names[name], [aliases.Deployment(model=f"anthropic/{MODEL}", api_base=url,
                                                                           key_name="bench-sim")])
                keys.mint(conn, valkey, key, keys.KeyRecord(owner=owner, aliases=list(names.values()),
                                                            budget_usd=None, expires_at=keys.expiry(3600)))
            pids = [recorded_pid(state / "gateway" / f"{n}.pid") for n in info.replicas]
            yield info, key, names, pids
            with psycopg.connect(database_url, autocommit=True) as conn:
                keys.revoke(conn, valkey, owner)  # its Valkey entries go with it
        finally:
            tier.stop(state)


def report(res: dict, conc: int, ways: list[str]) -> dict[tuple[str, bool, str], tuple[float, float]]:
    """Print each way's added p50/p99 over direct; -> {(way, stream, point): (p50, p99)}."""
    added = {}
    for stream, label in ((False, "non-stream"), (True, "stream")):
        points = ((1, "1st content"), (2, "last byte")) if stream else ((2, "response"),)
        for i, what in points:
            d = [x[i] for x in res[("direct", stream)]]
            parts = []
            for way in ways:
                xs = [x[i] for x in res[(way, stream)]]
                added[(way, stream, what)] = (bs.pct(xs, 50) - bs.pct(d, 50), bs.pct(xs, 99) - bs.pct(d, 99))
                parts.append(f"{way} p50 {added[(way, stream, what)][0]:+6.2f} p99 {added[(way, stream, what)][1]:+7.2f}")
            print(f"    c={conc:<2} {label:10} {what:11} direct p50 {bs.pct(d, 50):7.1f} p99 {bs.pct(d, 99):7.1f} ms"
                  f" (n={len(d)}); added: " + ", ".join(parts))
    return added


def capacity(database_url: str, valkey_url: str, calls: int, run: str) -> float:
    """Section 1: one replica flat out; -> its calls per second."""
    print(f"1. capacity: one replica (no balancer), an instant simulator, 16 callers in a closed loop, half streams,"
          f" {calls} calls a round; the shim on the same calls beside it")
    with (simulator_process(INSTANT) as instant,
          gateway_tier(database_url, valkey_url, 1, {"instant": instant}, run + "-cap") as (info, key, names, pids)):
        replica = f"http://127.0.0.1:{next(iter(info.replicas.values()))}"
        way = ("gateway", replica, key, names["instant"], pids[0])
        asyncio.run(bs.drive(way, 100, 16))  # warm-up: LiteLLM's first calls load what it loads lazily
        rounds = [bs.cpu_per_call(way, pids[0], calls) for _ in range(3)]
        for per, rate in rounds:
            print(f"    replica: {per:.2f} ms CPU per call, {rate:.1f} calls/s")
        with bs.shim_process(instant, valkey_url, run) as (via, proc, _):
            shim_way = ("shim", via, TOKEN, MODEL, proc.pid)
            asyncio.run(bs.drive(shim_way, 100, 16))
            shim_per, shim_rate = bs.cpu_per_call(shim_way, proc.pid, calls)
        print(f"    shim, beside it: {shim_per:.2f} ms CPU per call, {shim_rate:.1f} calls/s")
    rate = sorted(r for _, r in rounds)[1]
    per = sorted(p for p, _ in rounds)[1]
    print(f"    a replica serves {rate:.1f} calls/s flat out here (median of 3 rounds; {1000 / per:.0f} calls/s if"
          f" its {per:.1f} ms of CPU per call had a core to itself)")
    bs.verdict("calls per second per replica (median of 3)", f"{rate:.1f} calls/s, {per:.2f} ms CPU per call"
               f" (shim {shim_per:.2f} ms)", rate > 0)
    return rate


def latency(database_url: str, valkey_url: str, per_replica: float, quick: bool, run: str) -> None:
    """Section 2: the four ways at c=1 and c=CALLERS, on the tier the planner sizes for CALLERS callers."""
    with simulator_process(AGENT) as sim:
        async def call_s() -> float:
            import aiohttp
            async with aiohttp.ClientSession() as s:
                return (await bs.one(s, ("direct", sim, KEY, MODEL, None), False))[2] / 1000
        one_call = asyncio.run(call_s())
        load = CALLERS / one_call
        replicas = gateway_replicas(load, per_replica)
        print(f"2. added latency: agent-shaped calls ({AGENT.ttft_ms:.0f} ms to the first token, "
              f"{AGENT.tokens_per_s:.0f} tokens/s: {one_call:.2f} s each); {CALLERS} callers make {load:.1f} calls/s,"
              f" for which the planner sizes {replicas} replica(s) (at most {GATEWAY_UTILISATION:.0%} of"
              f" {per_replica:.1f} calls/s each); this machine has {os.cpu_count()} CPUs for all of it")
        with (gateway_tier(database_url, valkey_url, replicas, {"agent": sim}, run + "-lat") as (info, key, names, pids),
              bs.shim_process(sim, valkey_url, run) as (via, shim_proc, _),
              bs.shim_process(info.url, valkey_url, run + "gw", key=key, upstream_model=names["agent"])
              as (via_gw, shim_gw_proc, _)):
            ways = [("direct", sim, KEY, MODEL, None), ("shim", via, TOKEN, MODEL, shim_proc.pid),
                    ("gateway", info.url, key, names["agent"], pids[0]),
                    ("shim+gateway", via_gw, TOKEN, MODEL, shim_gw_proc.pid)]
            labels = [w[0] for w in ways[1:]]
            for conc, rounds, per_caller in ((1, 4 if quick else 12, 1), (CALLERS, 1 if quick else 3, 2)):
                print("   c=1: one caller per way, the ways taking turns" if conc == 1 else
                      f"   c={conc}: {rounds} round(s), in each the ways in turn, each under {conc} callers of its"
                      f" own making {per_caller} calls back to back")
                busy = bs.MachineBusy()
                res = asyncio.run(bs.latency(ways, conc, rounds, per_caller))
                print(f"    the machine's CPUs were {busy.share():.0%} busy meanwhile (load {os.getloadavg()[0]:.2f})")
                added = report(res, conc, labels)
                if conc == CALLERS:
                    for stream, what in ((False, "response"), (True, "1st content")):
                        p50, p99 = added[("shim+gateway", stream, what)]
                        bs.verdict(f"shim+gateway added at c={conc} ({'stream ' if stream else ''}{what})",
                                   f"p50 {p50:+.2f} ms, p99 {p99:+.2f} ms with {replicas} replica(s); gateway alone"
                                   f" p50 {added[('gateway', stream, what)][0]:+.2f} ms", p50 <= TARGET_MS)


def main() -> int:
    sections = ("capacity", "latency")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--valkey", default=os.environ.get("VALKEY_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--quick", action="store_true", help="fewer calls (noisier)")
    ap.add_argument("--only", nargs="+", choices=sections, default=sections, metavar="SECTION",
                    help=f"run only these sections (of {', '.join(sections)})")
    ap.add_argument("--replica-calls-per-s", type=float, default=None,
                    help="size the latency section's tier from this instead of section 1's figure")
    args = ap.parse_args()
    run = "bench" + uuid.uuid4().hex[:8]
    print(f"bench_gateway: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, python {sys.version.split()[0]}; "
          f"bytecode compiled for {bs.precompile()} more modules the shim loads")
    try:
        with bench_database() as database_url:
            per_replica = args.replica_calls_per_s
            if "capacity" in args.only:
                measured = capacity(database_url, args.valkey, 200 if args.quick else 600, run)
                per_replica = per_replica or measured
            if "latency" in args.only:
                latency(database_url, args.valkey, per_replica or GatewaySpec().replica_calls_per_s, args.quick, run)
    finally:
        bs.forget_run(args.valkey, run)
    bs.summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())
