"""The local stack: find PostgreSQL and Valkey where they answer, keep moto's S3/SQS server running on loopback.

PostgreSQL and Valkey are installed and started by scripts/stack.sh when nothing answers; here we only
check them and start moto (which the dispatcher owns locally) as a daemon under the state folder, so
that it outlives one dispatcher process and a `resume` finds the run's queues and job documents.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dispatcher.instances import PROJECT_ROOT

MOTO_PORT = int(os.environ.get("EVALPLANE_MOTO_PORT", "4599"))
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


def _answers(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _serves_s3(endpoint: str) -> bool:
    """The server lists buckets (S3's ListBuckets answers 200 on moto, whatever the credentials)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=5) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def ensure_moto() -> str:
    """Return the S3/SQS endpoint: $AWS_ENDPOINT_URL if set, else a moto server daemon on loopback."""
    for k, v in LOCAL_AWS_ENV.items():
        os.environ.setdefault(k, v)
    if os.environ.get("AWS_ENDPOINT_URL"):
        return os.environ["AWS_ENDPOINT_URL"]
    endpoint = f"http://127.0.0.1:{MOTO_PORT}"
    if _answers("127.0.0.1", MOTO_PORT) and not _serves_s3(endpoint):
        # e.g. a server left by a checkout since deleted: its imports fail and every call answers 500
        stop_moto()  # ours (its pid file in the state folder): start it afresh
        deadline = time.monotonic() + 10
        while _answers("127.0.0.1", MOTO_PORT) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _answers("127.0.0.1", MOTO_PORT):
            raise RuntimeError(f"port {MOTO_PORT} answers, but not as an S3/SQS server, and it is not this "
                               f"checkout's moto ({state_dir() / 'moto.pid'}): stop it, or set EVALPLANE_MOTO_PORT")
    if not _answers("127.0.0.1", MOTO_PORT):
        log = open(state_dir() / "moto.log", "ab")
        proc = subprocess.Popen(  # moto's server with its SQS message-loss race fixed (dispatcher.moto_server)
            [sys.executable, "-m", "dispatcher.moto_server", "-H", "127.0.0.1", "-p", str(MOTO_PORT)],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        (state_dir() / "moto.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + 20
        while not _answers("127.0.0.1", MOTO_PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not start; see {state_dir() / 'moto.log'}")
            time.sleep(0.1)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    return endpoint


def aws_env() -> dict[str, str]:
    """The AWS settings every process of a run needs (credentials for moto, endpoints, region)."""
    return {k: v for k, v in os.environ.items() if k in LOCAL_AWS_ENV or k.startswith("AWS_ENDPOINT_URL")}


def stop_moto() -> bool:
    pidfile = state_dir() / "moto.pid"
    if not pidfile.exists():
        return False
    try:
        os.killpg(int(pidfile.read_text()), signal.SIGTERM)
    except (ProcessLookupError, ValueError):
        pass
    pidfile.unlink(missing_ok=True)
    return True
