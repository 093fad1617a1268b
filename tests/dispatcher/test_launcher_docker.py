"""The docker launcher against a real engine and an image holding the task runtime (dispatcher.images).

The task network must let a task reach its allowed endpoints (through the egress) and nothing else:
not the host's ports (through the bridge addresses), not the allowed endpoints directly, not the internet.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from contract import aws, keys
from contract.models import AttemptLimits, AttemptRef, HarnessRef, Job, ModelRef

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "evalplane/launcher-test:runtime"  # the task runtime with the task's entrypoint, on a bare bullseye

docker = pytest.importorskip("docker")


@pytest.fixture(scope="session")
def engine(docker_engine):
    """A Docker engine and the task runtime built from this tree; in CI a missing engine fails, never skips."""
    import io

    from contract import task_shape
    from dispatcher.images import build_runtime

    client = docker.from_env(timeout=900)
    runtime = build_runtime(client, "mini-swe-agent")
    dockerfile = (f"FROM {runtime.base_tag}\nCOPY --from={runtime.harness_layer} / /\n"
                  f"ENTRYPOINT {json.dumps(task_shape.ENTRYPOINT)}\n")
    client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=IMAGE, rm=True, pull=False)
    return client


class Upstream(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"upstream-ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def serve(host: str) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer((host, 0), Upstream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def launcher(engine, moto_endpoint, valkey_url, unique, tmp_path):
    from dispatcher.launchers.docker import DockerLauncher

    upstream = serve("127.0.0.1")
    up_url = f"http://127.0.0.1:{upstream.server_address[1]}"
    env = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "EVALPLANE_UPSTREAM_KEY": "sk-test"}
    lau = DockerLauncher(env, [up_url, moto_endpoint, valkey_url], network=f"ep-{unique}",
                         log_dir=tmp_path / "logs", client=engine)
    lau.upstream_url, lau.allowed = up_url, [up_url, moto_endpoint, valkey_url]
    yield lau
    for c in engine.containers.list(all=True, filters={"network": lau.egress.name, "label": "evalplane.role=task"}):
        c.remove(force=True)
    for c in engine.containers.list(all=True, filters={"network": lau.egress.name, "label": "test.probe"}):
        c.remove(force=True)
    lau.close(remove_network=True)
    upstream.shutdown()
    assert lau.egress.bridge not in subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True, check=False).stdout


PROBE = r"""
import json, os, socket, sys, urllib.request
out = {}
try:
    out["allowed"] = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
except Exception as e:
    out["allowed"] = f"error: {e}"
for target in sys.argv[2:]:
    h, p = target.rsplit(":", 1)
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((h, int(p))); out[target] = "open"
    except Exception as e:
        out[target] = type(e).__name__
    finally:
        s.close()
try:
    socket.getaddrinfo(os.environ["PROBE_NAME"], 443); out["dns"] = "resolved"
except OSError:
    out["dns"] = "no"
print(json.dumps(out))
"""


def resolvable_name() -> str:
    """A name this host resolves (its own apt mirror, read from its configuration): a task must not."""
    from urllib.parse import urlsplit

    mirror = subprocess.run(["bash", "-c", ". scripts/lib/debian_mirror.sh && debian_mirror"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    name = urlsplit(mirror).hostname
    socket.getaddrinfo(name, 443)  # the control: the host does resolve it
    return name


def host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines() if " lo " not in line]


def test_task_reaches_its_upstream_through_the_egress_and_nothing_else(launcher, engine):
    forbidden = serve("0.0.0.0")  # a host service on every address: the classic leak through the bridge
    try:
        port = forbidden.server_address[1]
        up_port = launcher.upstream_url.rsplit(":", 1)[1]
        net = engine.networks.get(launcher.egress.name)
        gateway = net.attrs["IPAM"]["Config"][0]["Gateway"]
        targets = [f"{a}:{port}" for a in {*host_addresses(), gateway}]
        targets += [f"172.17.0.1:{up_port}", "1.1.1.1:443", "8.8.8.8:53"]  # the upstream directly; the internet
        # control: the host service does answer from the host, so a closed result inside means the network
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        out = engine.containers.run(IMAGE, ["-c", PROBE, launcher.task_url(launcher.upstream_url) + "/", *targets],
                                    entrypoint=["python3"], network=launcher.egress.name, labels={"test.probe": "1"},
                                    environment={"PROBE_NAME": resolvable_name()}, remove=True)
        seen = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        forbidden.shutdown()
    assert seen.pop("allowed") == "upstream-ok"
    assert seen.pop("dns") == "no"
    assert targets and all(seen[t] != "open" for t in targets), seen


def test_real_harness_task_fetches_its_job_and_reports_through_the_egress(launcher, engine, valkey, valkey_url,
                                                                            unique):
    """`python -m harness <job-uri>` in a container: job from S3, heartbeat in Valkey, result on SQS.

    The image has no /testbed and the repository source does not exist, so the attempt ends as an infrastructure
    error at set-up:
    what matters here is that all three endpoints are reached through the egress and the task exits 0.
    """
    s3, sqs = aws.client("s3"), aws.client("sqs")
    s3.create_bucket(Bucket=unique)
    q = sqs.create_queue(QueueName=f"{unique}-results")["QueueUrl"]
    ref = AttemptRef(run=unique, instance_id="demo__demo-1", attempt=1)
    job = Job(
        ref=ref, harness=HarnessRef(name="mini-swe-agent"),
        model=ModelRef(provider="openai", model="gpt-test", pool="p"), limits=AttemptLimits(max_turns=2),
        instance={"instance_id": ref.instance_id, "base_commit": "0" * 40, "problem_statement": "x"},
        repo_source="/nonexistent/repo.bundle", upstream_url=launcher.task_url(launcher.upstream_url),
        results_queue_url=q, artifacts_prefix=f"s3://{unique}/runs/{unique}/attempts/demo/1/",
        valkey_url=launcher.task_url(valkey_url),
    )
    uri = f"s3://{unique}/runs/{unique}/jobs/demo.json"
    aws.put_text(uri, job.model_dump_json())

    handle = launcher.launch(ref, uri, IMAGE)
    assert launcher.find_running(unique) == [handle] or launcher.poll(handle) is not None
    assert launcher.launch(ref, uri, IMAGE).task_id == handle.task_id or launcher.poll(handle) is not None
    c = engine.containers.get(handle.task_id)
    assert c.attrs["Config"]["Cmd"] == [uri]  # the job reference and nothing else
    assert c.labels["evalplane.attempt"] == "1" and c.labels["evalplane.run"] == unique

    deadline = time.monotonic() + 120
    while (code := launcher.poll(handle)) is None:
        assert time.monotonic() < deadline, "the task did not finish"
        time.sleep(0.5)
    log = (launcher.log_dir / "demo__demo-1.1.task.log").read_text()
    assert code == 0, log
    msgs = sqs.receive_message(QueueUrl=q, MaxNumberOfMessages=10, WaitTimeSeconds=2).get("Messages", [])
    assert len(msgs) == 1, log
    result = json.loads(msgs[0]["Body"])["msg"]
    assert result["ref"] == ref.model_dump() and result["outcome"] == "infra_error"
    assert result["error"].startswith("setup failed: ")  # no repository (and, outside a task image, no agent user)
    assert valkey.hget(keys.progress(ref), "phase") == b"done"
    assert launcher.find_running(unique) == []


def test_stop_and_find_running_after_a_restart(launcher, engine, unique):
    """A long task: a second launcher (a resumed dispatcher) finds it by its labels and stops it."""
    from dispatcher.launchers.docker import DockerLauncher

    ref = AttemptRef(run=unique, instance_id="slow__slow-1", attempt=2)
    c = engine.containers.run("evalplane/debian:bookworm", ["sleep", "300"], detach=True, init=True,
                              network=launcher.egress.name, name=f"ep-{unique}-slow",
                              labels={"evalplane.role": "task", "evalplane.run": unique,
                                      "evalplane.instance": ref.instance_id, "evalplane.attempt": "2"})
    egress_id = engine.containers.get(launcher.egress.egress_name).id
    again = DockerLauncher({}, launcher.allowed, network=launcher.egress.name, client=engine)
    try:
        found = again.find_running(unique)
        assert [(h.ref, h.task_id) for h in found] == [(ref, c.id)]
        assert engine.containers.get(launcher.egress.egress_name).id == egress_id  # the egress is reused
        assert again.poll(found[0]) is None
        again.stop(found[0])
        assert again.poll(found[0]) is not None
    finally:
        again.close()
