"""harness/usage.py: the task's compute as its cgroup counts it (read for real from this host's cgroup, and from
cgroup files of both versions' shapes), as the ECS task metadata endpoint v4 serves it (a local HTTP server serving
real-shaped documents), and as rusage counts it where the task has no cgroup of its own."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from contract.task_shape import OWN_CGROUP_ENV
from harness import usage

HOST_CGROUP = Path("/sys/fs/cgroup")


def burn(seconds_of_cpu: float) -> None:
    """Spend this much CPU in this process (CPU time, not wall time: a loaded host only makes it slower)."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0 = cpu()
    x = 0
    while cpu() - t0 < seconds_of_cpu:
        x += sum(range(10_000))


def test_the_cgroup_reader_reads_this_hosts_cgroup_and_its_cpu_count_grows(tmp_path):
    if not (HOST_CGROUP / "cpu.stat").exists() and not (HOST_CGROUP / "cpuacct" / "cpuacct.usage").exists():
        pytest.fail("no cgroup v1 or v2 CPU accounting under /sys/fs/cgroup")
    before = usage.cgroup_usage(HOST_CGROUP)
    burn(0.3)
    after = usage.cgroup_usage(HOST_CGROUP)
    assert before.source == "cgroup" and before.cpu_s is not None and before.cpu_s > 0
    assert after.cpu_s - before.cpu_s >= 0.3  # the cgroup holds this process, and maybe others
    assert after.memory_peak_bytes is None or after.memory_peak_bytes > 0
    assert usage.cgroup_oom_kills(HOST_CGROUP) is None or usage.cgroup_oom_kills(HOST_CGROUP) >= 0


def _v2(root: Path, usec: int, peak: int, oom_kill: int) -> None:
    (root / "cpu.stat").write_text(f"usage_usec {usec}\nuser_usec {usec - 10}\nsystem_usec 10\n")
    (root / "memory.peak").write_text(f"{peak}\n")
    (root / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {oom_kill}\noom_group_kill 0\n")


def _v1(root: Path, ns: int, peak: int, oom_kill: int) -> None:
    (root / "cpuacct").mkdir(exist_ok=True)
    (root / "memory").mkdir(exist_ok=True)
    (root / "cpuacct" / "cpuacct.usage").write_text(f"{ns}\n")
    (root / "memory" / "memory.max_usage_in_bytes").write_text(f"{peak}\n")
    (root / "memory" / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")


@pytest.mark.parametrize("shape", [_v2, _v1])
def test_both_cgroup_versions_give_cpu_peak_and_the_oom_kills_since_the_meter_started(tmp_path, shape):
    shape(tmp_path, 2_500_000 if shape is _v2 else 2_500_000_000, 300 * 2**20, 0)
    meter = usage.Meter(env={OWN_CGROUP_ENV: "1"}, cgroup_root=tmp_path)
    u = meter.usage()
    assert (u.source, u.cpu_s, u.memory_peak_bytes) == ("cgroup", 2.5, 300 * 2**20)
    assert not meter.oom_killed()
    shape(tmp_path, 2_600_000 if shape is _v2 else 2_600_000_000, 400 * 2**20, 1)  # the kernel killed one
    assert meter.oom_killed()


def test_without_a_cgroup_of_its_own_the_task_reports_rusage_and_no_oom_check(tmp_path):
    _v2(tmp_path, 1, 1, 5)
    meter = usage.Meter(env={}, cgroup_root=tmp_path, started=time.monotonic() - 2)
    u = meter.usage()
    assert u.source == "rusage" and u.cpu_s > 0 and u.memory_peak_bytes > 0 and u.wall_s >= 2
    assert meter.oom_kills() is None and not meter.oom_killed()


# Real-shaped documents of the ECS task metadata endpoint v4 (Fargate platform 1.4; the shapes AWS documents:
# /task/stats is Docker's stats document per container, keyed by Docker id; a stopped container's is null).
TASK = {
    "Cluster": "arn:aws:ecs:us-east-1:111122223333:cluster/evalplane", "TaskARN":
        "arn:aws:ecs:us-east-1:111122223333:task/evalplane/158d1c8083dd49d6b527399fd6414f5c",
    "Family": "evalplane-harness", "Revision": "7", "DesiredStatus": "RUNNING", "KnownStatus": "RUNNING",
    "Limits": {"CPU": 1, "Memory": 4096}, "PullStartedAt": "2026-12-05T10:00:00.202617438Z",
    "PullStoppedAt": "2026-12-05T10:00:40.105229538Z", "AvailabilityZone": "us-east-1a", "LaunchType": "FARGATE",
    "Containers": [
        {"DockerId": "1e3b4f2a", "Name": "task", "Image": "111122223333.dkr.ecr.us-east-1.amazonaws.com/evalplane/task@sha256:ab",
         "KnownStatus": "RUNNING", "Limits": {"CPU": 1024, "Memory": 4096}, "CreatedAt": "2026-12-05T10:00:41.0Z",
         "StartedAt": "2026-12-05T10:00:42.0Z", "Type": "NORMAL"},
        {"DockerId": "9a8b7c6d", "Name": "~internal~ecs~pause", "KnownStatus": "RESOURCES_PROVISIONED",
         "StartedAt": "2026-12-05T10:00:41.5Z", "Type": "CNI_PAUSE"},
    ],
}


def _stats(total_ns: int, max_usage: int) -> dict:
    return {
        "read": "2026-12-05T10:05:00.123456789Z", "preread": "2026-12-05T10:04:50.123456789Z", "num_procs": 0,
        "pids_stats": {"current": 9},
        "cpu_stats": {"cpu_usage": {"total_usage": total_ns, "percpu_usage": [total_ns // 2, total_ns // 2],
                                    "usage_in_kernelmode": total_ns // 10, "usage_in_usermode": total_ns // 2},
                      "system_cpu_usage": 31_940_000_000_000, "online_cpus": 2,
                      "throttling_data": {"periods": 0, "throttled_periods": 0, "throttled_time": 0}},
        "precpu_stats": {"cpu_usage": {"total_usage": total_ns - 10**9}, "system_cpu_usage": 31_920_000_000_000},
        "memory_stats": {"usage": max_usage // 2, "max_usage": max_usage, "limit": 4 * 2**30,
                         "stats": {"rss": max_usage // 3, "cache": 1_000_000}},
        "name": "ecs-evalplane-harness-7-task", "id": "1e3b4f2a",
        "networks": {"eth1": {"rx_bytes": 1000, "tx_bytes": 2000}},
    }


STATS = {"1e3b4f2a": _stats(93_500_000_000, 812 * 2**20), "9a8b7c6d": _stats(20_000_000, 2**20),
         "5f5f5f5f": None}


@pytest.fixture
def metadata_endpoint():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            doc = {"/v4/abc/task": TASK, "/v4/abc/task/stats": STATS}.get(self.path)
            body = json.dumps(doc).encode()
            self.send_response(200 if doc is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v4/abc"
    srv.shutdown()


def test_the_ecs_reader_sums_the_tasks_containers_and_counts_its_life_from_the_image_pull(metadata_endpoint):
    now = datetime(2026, 12, 5, 10, 15, 0, 202617, tzinfo=UTC)
    u = usage.ecs_usage(metadata_endpoint, now=now)
    assert u.source == "ecs"
    assert u.cpu_s == pytest.approx(93.52)  # the task's container and the pause container; the null one skipped
    assert u.memory_peak_bytes == 812 * 2**20 + 2**20
    assert u.wall_s == pytest.approx(15 * 60)  # Fargate bills from the image pull's start


def test_on_ecs_the_meter_reads_the_endpoint_and_falls_back_to_rusage_when_it_does_not_answer(metadata_endpoint,
                                                                                            tmp_path):
    env = {usage.ECS_METADATA_ENV: metadata_endpoint}
    assert usage.Meter(env=env, cgroup_root=tmp_path).usage().source == "ecs"
    gone = usage.Meter(env={usage.ECS_METADATA_ENV: metadata_endpoint + "/nothing"}, cgroup_root=tmp_path)
    assert gone.usage().source == "rusage"
