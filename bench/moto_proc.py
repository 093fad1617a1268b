"""The S3/SQS stand-in (moto's server, fixed: dispatcher/backends/moto_server.py) as a subprocess on a free loopback port, for
the benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_moto(timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """(the process, its endpoint URL) once it accepts connections; the caller kills it. RuntimeError if it
    exits or does not listen within `timeout_s`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher.backends.moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"moto's server did not start on port {port}") from None
            time.sleep(0.05)
