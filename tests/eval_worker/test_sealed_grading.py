"""Docker grading runs the model's code sealed: on a network whose only way out is the package index, without
CAP_SYS_ADMIN, with no-new-privileges; an instance that needs the index resolves through it, and lands infra_error,
never UNRESOLVED, when the index is down."""

from __future__ import annotations

import json
import secrets

import docker
from ew_helpers import make_job, patch_from_edits

from contract.models import EvalOutcome
from dispatcher.launchers.docker import task_network
from eval_worker.docker_backend import INDEX_DOWN, DockerGrader
from eval_worker.grading import grade, infra_entry
from eval_worker.layout import instance_log_dir
from plumbing.egress import EGRESS_IMAGE, bridge_gateway

MODEL = "evalplane/demo-model"
PROBE = r"""
import json, socket, urllib.request
out = {}
def connect(label, host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        out[label] = "connected"
    except Exception as e:
        out[label] = type(e).__name__
for label, host, port in TARGETS:
    connect(label, host, port)
try:
    req = urllib.request.Request(INDEX + "pip/", headers={"Accept": "text/html"})  # as pip asks
    with urllib.request.urlopen(req, timeout=20) as r:
        out["index"] = "HTTP %d" % r.status
except Exception as e:
    out["index"] = type(e).__name__
try:
    socket.getaddrinfo("evalplane-exfil.invalid", 80)
    out["dns"] = "resolved"
except Exception as e:
    out["dns"] = type(e).__name__
caps = [l for l in open("/proc/self/status") if l.startswith(("CapEff", "NoNewPrivs"))]
out["status"] = "".join(caps)
print(json.dumps(out))
"""


def test_a_grading_container_reaches_the_index_and_nothing_else(docker_client, package_index):
    backend = DockerGrader(client=docker_client, package_index=package_index)
    sealed = backend.sealed_client
    gateway = bridge_gateway(docker_client)
    index_port = int(package_index.split(":")[2].split("/")[0])
    targets = [("index on the host's bridge address", gateway, index_port), ("host ssh", gateway, 22),
               ("postgres", gateway, 5432), ("own loopback postgres", "127.0.0.1", 5432),
               ("metadata", "169.254.169.254", 80), ("ecs metadata", "169.254.170.2", 80),
               ("tasks egress", task_network() + "-egress", 4599)]
    index = sealed.environment["PIP_INDEX_URL"]
    code = f"TARGETS = {targets!r}\nINDEX = {index!r}\n" + PROBE
    # what run_instance asks for (swebench's create_container), sealed on the way
    c = sealed.containers.create(image=EGRESS_IMAGE, name=f"ep-sealed-test-{secrets.token_hex(4)}", user="root",
                                 detach=True, command=["python3", "-c", code], cap_add=["SYS_ADMIN"])
    try:
        c.start()
        assert c.wait(timeout=120)["StatusCode"] == 0, c.logs().decode()
        found = json.loads(c.logs().decode().strip().splitlines()[-1])
        c.reload()
        host = c.attrs["HostConfig"]
        assert list(c.attrs["NetworkSettings"]["Networks"]) == [backend.network]
        assert "SYS_ADMIN" not in (host.get("CapAdd") or []) and "no-new-privileges" in host["SecurityOpt"]
    finally:
        c.remove(force=True)
    assert found.pop("index") == "HTTP 200", found  # through the egress: pip's index, the one thing it reaches
    assert index.startswith("http://") and gateway not in index
    assert found.pop("dns") != "resolved", found
    for label in [t[0] for t in targets]:
        assert found.pop(label) != "connected", label
    assert "NoNewPrivs:\t1" in found["status"]
    eff = int(found["status"].split("CapEff:\t")[1].split()[0], 16)
    assert not eff & (1 << 21), found["status"]  # CAP_SYS_ADMIN is bit 21


def test_an_instance_without_its_wheelhouse_resolves_through_the_index(docker_client, package_index, online_row,
                                                                         tmp_path):
    backend = DockerGrader(client=docker_client, package_index=package_index)
    v = grade(make_job(online_row, run="online", model=MODEL), online_row["patch"], tmp_path, backend)
    assert v.outcome is EvalOutcome.RESOLVED, (v.reason, v.report)
    out = (instance_log_dir(tmp_path, "online", 1, MODEL, online_row["instance_id"]) / "test_output.txt").read_text()
    # the eval script's own install fetched its build backend from the index (build isolation, no wheelhouse)
    assert f"Looking in indexes: {backend.sealed_client.environment['PIP_INDEX_URL']}" in out, out[-3000:]
    assert "Successfully installed calc" in out, out[-3000:]


def test_with_the_index_down_it_is_infra_error_never_unresolved(docker_client, online_row, tmp_path):
    gateway = bridge_gateway(docker_client)
    down = f"http://{gateway}:9/index/"  # nothing listens there
    backend = DockerGrader(client=docker_client, package_index=down, network="evalplane-grading-test-down")
    wrong = patch_from_edits(online_row, [("README.md", "# calc\n", "# calc: a wrong fix\n")], tmp_path)
    try:
        for patch in (online_row["patch"], wrong):  # the gold patch and a wrong one: neither is graded
            v = grade(make_job(online_row, run="indexdown", model=MODEL), patch, tmp_path, backend)
            assert v.outcome is EvalOutcome.INFRA_ERROR and not v.resolved, v
            assert v.report == infra_entry(INDEX_DOWN) and down in v.reason
    finally:
        from plumbing.egress import Egress

        Egress(docker_client, backend.network, [], EGRESS_IMAGE, host_address=False).down()
    try:
        docker_client.networks.get(backend.network)
        raise AssertionError("the test's network was left behind")
    except docker.errors.NotFound:
        pass
