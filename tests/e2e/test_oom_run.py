"""A task that exceeds its memory limit, on the docker launcher: the harness policy has the agent run a command that
allocates past `backend.task_memory_limit`; the kernel kills it inside the task's container, the task runner sees
the kill in its own cgroup, and the attempt lands infra_error (oom_killed), never graded and never the model's;
the official report lists it among the infrastructure failures. The other attempt of the run, with room to spare,
is graded as usual."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from test_docker_run import docker_spec, images  # noqa: F401 - the module's image fixture, used by name
from test_local_run import dispatcher, instances

from contract.models import OOM_KILLED

pytestmark = pytest.mark.e2e
GREEDY = "python3 -c \"b = b'x' * (3 << 30)\""  # 3 GiB written, well past the 1 GiB limit


def test_a_task_killed_at_its_memory_limit_lands_infra_error_oom_killed(images, tmp_path, env,  # noqa: F811
                                                                       database_url, unique):
    greedy, calm = (row["instance_id"] for row in instances()[:2])
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": {"action": "gold"},
                                  "instances": {greedy: {"action": "gold", "command": GREEDY}}}))
    spec = docker_spec(tmp_path, unique, "off")
    text = spec.read_text()
    text = text.replace('launcher = "docker"', 'launcher = "docker"\ntask_memory = "512m"\ntask_memory_limit = "1g"')
    text = text.replace("[instances]", f"[instances]\nids = {json.dumps([greedy, calm])}")
    text = text.replace(f'policy = "{Path(__file__).resolve().parents[2]}/examples/synthetic/demo_policy.json"',
                        f'policy = "{policy}"')
    spec.write_text(text)
    assert str(policy) in spec.read_text()
    built = dispatcher(env, "images", str(spec), timeout=2400)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]

    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"), timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    with psycopg.connect(database_url) as conn:
        rows = {r[0]: r[1:] for r in conn.execute(
            "SELECT instance_id, status, outcome, error, eval_enqueued_at, task_memory_limit_mib, task_memory_peak_bytes,"
            " usage_source FROM attempts WHERE run = %s", (unique,))}
    status, outcome, error, enqueued, limit, peak, source = rows[greedy]
    assert (status, outcome, enqueued) == ("INFRA_ERROR", "infra_error", None)  # never graded
    assert error.startswith(f"{OOM_KILLED}: ") and limit == 1024 and source == "cgroup"
    assert peak is not None and peak > 512 * 2**20  # the container's peak reached past its guarantee
    assert rows[calm][0] == "RESOLVED"
    report = json.loads((tmp_path / "out" / f"gpt-4o-mini.{unique}.json").read_text())
    assert report["infra_failure_ids"] == [greedy] and report["failure_reasons"][greedy] == OOM_KILLED
    assert greedy not in report["unresolved_ids"] + report["empty_patch_ids"] + report["error_ids"]
