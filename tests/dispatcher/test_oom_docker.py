"""Container resources on a real engine: the docker launcher gives each task the spec's CPUs, its guaranteed memory
and its kill threshold; a task killed at that threshold is reported as oom_killed (the launcher's exit_reason, from
the engine's State.OOMKilled), and a task whose agent's command is killed for memory sees it in its own cgroup
(harness/usage.py, as the task runner reads it inside its container) and lands infra_error, never the model's."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from contract.models import OOM_KILLED, AttemptRef, TaskResources

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "evalplane/oom-test:stand-in"
BASE = "evalplane/debian:bookworm"  # python3 on Debian (scripts/docker.sh)
# A stand-in task whose one argument says what to do: hold (sleep), or allocate past any small limit.
STAND_IN = ("import sys, time\n"
            "if sys.argv[1] == 'allocate':\n"
            "    blocks = [bytearray(64 * 2**20) for _ in range(32)]\n"
            "time.sleep(120)\n")


@pytest.fixture(scope="module")
def engine(docker_engine):
    dockerfile = f"FROM {BASE}\nENTRYPOINT {json.dumps(['python3', '-c', STAND_IN])}\n"
    docker_engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=IMAGE, rm=True, pull=False)
    return docker_engine


@pytest.fixture
def launcher(engine, unique, tmp_path):
    from dispatcher.launchers.docker import DockerLauncher

    lau = DockerLauncher({}, [], network=f"ep-{unique}", log_dir=tmp_path / "logs", client=engine,
                         resources=TaskResources(cpu=0.5, memory_mib=96, memory_limit_mib=128))
    yield lau
    for c in engine.containers.list(all=True, filters={"network": lau.egress.name, "label": "evalplane.role=task"}):
        c.remove(force=True)
    lau.close(remove_network=True)


def wait_exit(launcher, handle, bound_s: float = 120) -> int:
    deadline = time.monotonic() + bound_s
    while (code := launcher.poll(handle)) is None:
        assert time.monotonic() < deadline, "the task did not end"
        time.sleep(0.5)
    return code


def test_each_task_gets_the_specs_cpus_guarantee_and_limit(launcher, engine, unique):
    handle = launcher.launch(AttemptRef(run=unique, instance_id="hold", attempt=1), "hold", image=IMAGE)
    host = engine.containers.get(handle.task_id).attrs["HostConfig"]
    assert (host["NanoCpus"], host["MemoryReservation"], host["Memory"]) == (5 * 10**8, 96 * 2**20, 128 * 2**20)
    launcher.stop(handle)
    assert wait_exit(launcher, handle) is not None
    assert launcher.exit_reason(handle) is None  # stopped, not killed for memory


def test_a_task_killed_at_its_memory_limit_is_oom_killed(launcher, unique):
    handle = launcher.launch(AttemptRef(run=unique, instance_id="greedy", attempt=1), "allocate", image=IMAGE)
    assert wait_exit(launcher, handle) == 137  # SIGKILL, from the kernel's OOM killer
    assert launcher.exit_reason(handle) == OOM_KILLED


# Inside a container limited to 128 MiB: the task runner's meter, and the verdict it gives an attempt whose agent
# (here, a command it ran) was killed for memory. The runner's code and its packages come from this checkout.
IN_TASK = """
import json, subprocess, sys
from contract.models import HarnessOutcome, TaskResources
from harness import usage
from harness.task import oom_verdict

meter = usage.Meter()
p = subprocess.run([sys.executable, "-c", "b = [bytearray(64 * 2**20) for _ in range(32)]"], check=False)
job = type("J", (), {"resources": TaskResources(cpu=1, memory_mib=96, memory_limit_mib=128)})()
outcome, error = oom_verdict(meter, job, HarnessOutcome.SUBMITTED, None)
print(json.dumps({"child": p.returncode, "oom": meter.oom_killed(), "usage": meter.usage().model_dump(),
                  "outcome": outcome.value, "error": error}))
"""


def test_the_task_runner_sees_its_agents_oom_kill_in_its_own_cgroup_and_lands_infra_error(engine):
    import sys
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    version = engine.containers.run(BASE, ["python3", "-c", "import sys; print(sys.version_info[:2])"], remove=True)
    assert version.decode().strip() == str(tuple(sys.version_info[:2])), "the base image's Python is not this one's"
    out = engine.containers.run(
        BASE, ["python3", "-c", IN_TASK], remove=True, mem_limit="128m", mem_reservation="96m",
        memswap_limit="128m", environment={"EVALPLANE_OWN_CGROUP": "1", "PYTHONPATH": f"/src:{site}"},
        volumes={str(ROOT): {"bind": "/src", "mode": "ro"}, site: {"bind": site, "mode": "ro"}},
        network_mode="none", init=True)
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got["child"] == -9 and got["oom"] is True
    assert got["outcome"] == "infra_error" and got["error"].startswith(f"{OOM_KILLED}: ")
    u = got["usage"]
    assert u["source"] == "cgroup" and u["cpu_s"] > 0 and u["wall_s"] > 0
    assert 64 * 2**20 < u["memory_peak_bytes"] <= 128 * 2**20  # the peak is the container's, at its limit
