"""The S3/SQS stand-in (moto's server, fixed: dispatcher/backends/moto_server.py) as a subprocess on a free loopback
port, for the benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from plumbing.services import Service, free_port

ROOT = Path(__file__).resolve().parent.parent


def start_moto(timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """(the process, its endpoint URL) once it accepts connections; the caller kills it. ServiceFailed (a
    RuntimeError) if it exits or does not listen within `timeout_s`."""
    port = free_port()
    moto = Service([sys.executable, "-m", "dispatcher.backends.moto_server", "-H", "127.0.0.1", "-p", str(port)],
                   name="moto's server", cwd=ROOT, tcp=("127.0.0.1", port), timeout_s=timeout_s, poll_s=0.05).start()
    return moto.proc, f"http://127.0.0.1:{port}"
