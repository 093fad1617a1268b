"""The shim bench's yardsticks do what they stand for: the LiteLLM proxy it starts serves the same calls from
the same simulator as the direct way and the shim (the paced model, and the instant one by its name), streams
and not, and the bench's clock sees each stream's first content after its head and before its end."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_shim as bench

from simulator import SimulatorConfig
from simulator.testing import simulator_process


def _requests(url: str) -> int:
    return httpx.get(f"{url}/_sim/stats", timeout=10).json()["models"].get(bench.MODEL, {}).get("requests", 0)


def test_each_way_serves_the_same_calls(valkey_url):
    run = "t" + uuid.uuid4().hex[:10]
    instant_cfg = SimulatorConfig(api_key=bench.KEY, rpm=0, itpm=0, otpm=0)
    with (simulator_process(bench.PACED) as paced, simulator_process(instant_cfg) as instant,
          bench.litellm_process(paced, instant) as (litellm, master, litellm_proc, _),
          bench.shim_process(paced, valkey_url, run) as (via, shim_proc, ready)):
        assert 0 < ready < 30
        ways = [("direct", paced, bench.KEY, bench.MODEL, None), ("shim", via, bench.TOKEN, bench.MODEL, shim_proc.pid),
                ("litellm", litellm, master, bench.MODEL, litellm_proc.pid)]
        res = asyncio.run(bench.latency(ways, 1, 2))
        for way in ("direct", "shim", "litellm"):
            for stream in (False, True):
                times = res[(way, stream)]
                assert len(times) == 2, (way, stream)
                for first, content, last in times:
                    assert last >= bench.PACED.ttft_ms * 0.9  # the model's time to first token is in every call
                    if stream:  # the head, then the content (after the model's first token), then the end; the
                        # head's own time is the bench's figure, not a bound here (a loaded machine delays it)
                        assert first <= content <= last and content >= bench.PACED.ttft_ms * 0.9, (way, first, content,
                                                                                                   last)
        # each way, non-stream and stream: a warm-up call and 2 measured ones; direct, 2 more (a call's duration)
        assert _requests(paced) == 3 * (2 + 4) + 2
        asyncio.run(bench.drive(("litellm", litellm, master, bench.INSTANT, litellm_proc.pid), 4, 2))
        assert _requests(instant) == 4 and _requests(paced) == 3 * (2 + 4) + 2
    r = redis.Redis.from_url(valkey_url)
    r.delete(*(list(r.scan_iter(match=f"*{run}*")) or [f"{run}:none"]))
    r.close()
