"""The local stack: find PostgreSQL and Valkey where they answer, keep moto's S3/SQS server running on loopback.

PostgreSQL and Valkey are installed and started by scripts/stack.sh when nothing answers; here we only
check them and start moto (which the dispatcher owns locally) as a daemon under the state folder, so
that it outlives one dispatcher process and a `resume` finds the run's queues and job documents. The package
index that docker gradings reach (eval_worker.package_index) and the gateway tier (gateway/tier.py) are daemons of the
same kind.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path

from dispatcher.instances import PROJECT_ROOT
from plumbing.services import Service, stop_recorded, tcp_answers

MOTO_PORT = int(os.environ.get("EVALPLANE_MOTO_PORT", "4599"))
INDEX_PORT = int(os.environ.get("EVALPLANE_INDEX_PORT", "4597"))
LOCAL_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "local",
    "AWS_SECRET_ACCESS_KEY": "local",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def state_dir() -> Path:
    p = Path(os.environ.get("EVALPLANE_STATE_DIR", PROJECT_ROOT / ".state"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def _serves_s3(endpoint: str) -> bool:
    """The server lists buckets (S3's ListBuckets answers 200 on moto, whatever the credentials)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=5) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _daemon(name: str, what: str, argv: list[str], host: str, port: int, port_env: str, serves) -> None:
    """argv as a daemon of this checkout's (pid file and log <name>.pid/.log in the state folder) answering on
    host:port, unless one that serves() already does; one that answers but does not serve is restarted when it is
    ours (e.g. left by a checkout since deleted, whose imports fail), else refused naming the port and `port_env`."""
    if tcp_answers(host, port) and not serves():
        stop(name)
        deadline = time.monotonic() + 10
        while tcp_answers(host, port) and time.monotonic() < deadline:
            time.sleep(0.1)
        if tcp_answers(host, port):
            raise RuntimeError(f"port {port} answers, but not as {what} server, and it is not this checkout's "
                               f"{name} ({state_dir() / (name + '.pid')}): stop it, or set {port_env}")
    if not tcp_answers(host, port):  # detached: it outlives this process (stop() ends it, from any process)
        Service(argv, name=f"the {name} server", log=state_dir() / f"{name}.log", tcp=(host, port), poll_s=0.1,
                new_session=True, pidfile=state_dir() / f"{name}.pid").start()


def ensure_moto() -> str:
    """Return the S3/SQS endpoint: $AWS_ENDPOINT_URL if set, else a moto server daemon on loopback."""
    for k, v in LOCAL_AWS_ENV.items():
        os.environ.setdefault(k, v)
    if os.environ.get("AWS_ENDPOINT_URL"):
        return os.environ["AWS_ENDPOINT_URL"]
    endpoint = f"http://127.0.0.1:{MOTO_PORT}"
    # moto's server with its SQS message-loss race fixed (dispatcher.backends.moto_server)
    _daemon("moto", "an S3/SQS",
            [sys.executable, "-m", "dispatcher.backends.moto_server", "-H", "127.0.0.1", "-p", str(MOTO_PORT)],
            "127.0.0.1", MOTO_PORT, "EVALPLANE_MOTO_PORT", lambda: _serves_s3(endpoint))
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    return endpoint


def ensure_package_index() -> str:
    """The package index grading containers may reach (eval_worker.package_index): $EVALPLANE_PACKAGE_INDEX if set,
    else the project's proxy as a daemon on the Docker bridge's gateway address, where only containers on the default
    bridge (the grading network's egress) and this host reach it; its cache under the state folder."""
    from eval_worker import package_index

    if os.environ.get(package_index.PACKAGE_INDEX_ENV):
        return os.environ[package_index.PACKAGE_INDEX_ENV]
    import docker

    from plumbing.egress import bridge_gateway

    host = bridge_gateway(docker.from_env())
    url = package_index.url_for(host, INDEX_PORT)
    cache = state_dir() / "package-index"
    cache.mkdir(exist_ok=True)
    _daemon("package-index", "a package index",
            [sys.executable, "-m", "eval_worker.package_index", "--host", host, "--port", str(INDEX_PORT),
             "--cache-dir", str(cache)], host, INDEX_PORT, "EVALPLANE_INDEX_PORT", lambda: package_index.healthy(url))
    return url


def ensure_gateway(valkey_url: str, replicas: int = 2):
    """The gateway tier on this host (gateway/tier.py) on the run's database and Valkey (admin URL), started if it
    does not answer: its TierInfo."""
    from contract import db
    from gateway import tier

    return tier.ensure(state_dir(), db.database_url(), valkey_url, replicas)


def stop_gateway() -> bool:
    from gateway import tier

    return tier.stop(state_dir())


def aws_env() -> dict[str, str]:
    """The AWS settings every process of a run needs (credentials for moto, endpoints, region)."""
    return {k: v for k, v in os.environ.items() if k in LOCAL_AWS_ENV or k.startswith("AWS_ENDPOINT_URL")}


def stop(name: str) -> bool:
    """Stop this checkout's daemon `name` (moto, package-index), if it runs."""
    return stop_recorded(state_dir() / f"{name}.pid")


def stop_moto() -> bool:
    return stop("moto")
