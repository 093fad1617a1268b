"""What this task's compute used, read where it runs (contract.models.ComputeUsage), and whether the kernel killed
anything in it for memory:

- in a container of its own (the docker launcher sets OWN_CGROUP_ENV): its cgroup, v2 (cpu.stat usage_usec,
  memory.peak, memory.events oom_kill) or v1 (cpuacct.usage, memory.max_usage_in_bytes, memory.oom_control);
- on ECS (the agent sets ECS_CONTAINER_METADATA_URI_V4): the task metadata endpoint v4, /task/stats (Docker's stats
  document per container) and /task (when the task's image pull started: Fargate bills from there);
- otherwise (a process on a shared host, the process launcher): the runner's rusage and its children's.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from contract.models import ComputeUsage
from contract.task_shape import OWN_CGROUP_ENV

log = logging.getLogger("evalplane.usage")
ECS_METADATA_ENV = "ECS_CONTAINER_METADATA_URI_V4"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _keyed(text: str | None, key: str) -> int | None:
    """`key N` from a flat-keyed cgroup file (cpu.stat, memory.events, memory.oom_control)."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


def container_wall_s(proc: Path = Path("/proc")) -> float | None:
    """How long this container has lived: since its PID 1 started (a container has a PID namespace of its own)."""
    stat, uptime = _read(proc / "1" / "stat"), _read(proc / "uptime")
    if stat is None or uptime is None:
        return None
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command's parentheses
    return max(0.0, float(uptime.split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"))


def cgroup_usage(root: Path = CGROUP_ROOT, proc: Path = Path("/proc")) -> ComputeUsage:
    """The cgroup mounted at root (a container's own), v2 if it has cpu.stat there, else v1's controllers."""
    if (root / "cpu.stat").exists():
        usec = _keyed(_read(root / "cpu.stat"), "usage_usec")
        peak = _read(root / "memory.peak")
        cpu_s = None if usec is None else usec / 1e6
    else:
        ns = _read(root / "cpuacct" / "cpuacct.usage")
        peak = _read(root / "memory" / "memory.max_usage_in_bytes")
        cpu_s = None if ns is None else int(ns) / 1e9
    return ComputeUsage(source="cgroup", cpu_s=cpu_s, memory_peak_bytes=int(peak) if peak else None,
                        wall_s=container_wall_s(proc))


def cgroup_oom_kills(root: Path = CGROUP_ROOT) -> int | None:
    """Processes the kernel has killed in this cgroup for memory (None: not readable here)."""
    if (root / "memory.events").exists():
        return _keyed(_read(root / "memory.events"), "oom_kill")
    return _keyed(_read(root / "memory" / "memory.oom_control"), "oom_kill")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def ecs_usage(base_url: str, now: datetime | None = None) -> ComputeUsage:
    """The task's figures from the ECS task metadata endpoint v4: CPU (total_usage, ns) and memory peak (max_usage,
    else usage) summed over its containers' stats, and its life since its image pull started."""
    stats = _get_json(base_url.rstrip("/") + "/task/stats")
    task = _get_json(base_url.rstrip("/") + "/task")
    cpu_ns = peak = 0
    for doc in stats.values():
        if not doc:  # a container not running yet (or any more) has null stats
            continue
        cpu_ns += int(doc.get("cpu_stats", {}).get("cpu_usage", {}).get("total_usage", 0))
        mem = doc.get("memory_stats", {})
        peak += int(mem.get("max_usage") or mem.get("usage") or 0)
    began = task.get("PullStartedAt") or min((c["StartedAt"] for c in task.get("Containers", []) if c.get("StartedAt")),
                                             default=None)
    wall = None
    if began:
        wall = max(0.0, ((now or datetime.now(UTC)) - datetime.fromisoformat(began))
                   .total_seconds())
    return ComputeUsage(source="ecs", cpu_s=cpu_ns / 1e9, memory_peak_bytes=peak or None, wall_s=wall)


def rusage_usage(started: float) -> ComputeUsage:
    """This process's and its reaped children's CPU; the larger of their peaks (ru_maxrss is KiB on Linux)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return ComputeUsage(source="rusage", cpu_s=me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                        memory_peak_bytes=max(me.ru_maxrss, kids.ru_maxrss) * 1024,
                        wall_s=time.monotonic() - started)


class Meter:
    """The task's compute meter, from where it runs (module docstring). started: time.monotonic() at the start."""

    def __init__(self, env: dict[str, str] | None = None, started: float | None = None,
                 cgroup_root: Path = CGROUP_ROOT):
        env = os.environ if env is None else env
        self.ecs = env.get(ECS_METADATA_ENV)
        self.own_cgroup = env.get(OWN_CGROUP_ENV) == "1" or bool(self.ecs)
        self.started = time.monotonic() if started is None else started
        self.root = cgroup_root
        self.oom_at_start = self.oom_kills()

    def oom_kills(self) -> int | None:
        return cgroup_oom_kills(self.root) if self.own_cgroup else None

    def oom_killed(self) -> bool:
        """Whether the kernel killed something in this task for memory since the meter started."""
        now = self.oom_kills()
        return now is not None and now > (self.oom_at_start or 0)

    def usage(self) -> ComputeUsage:
        """Never raises: a reader that fails falls back to rusage (and says so in the log)."""
        try:
            if self.ecs:
                return ecs_usage(self.ecs)
            if self.own_cgroup:
                return cgroup_usage(self.root)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("reading the task's compute failed (%s); recording the runner's rusage instead", e)
        return rusage_usage(self.started)
