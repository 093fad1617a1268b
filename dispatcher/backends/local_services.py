"""The per-run local services of the local backend: the provider simulator and the eval workers.

They run in sessions of their own and their pids are recorded under the run's folder, so that a
killed dispatcher leaves them serving the tasks that are still running, a resumed dispatcher reuses
the simulator (same port, same key), and the run's end stops all of them, old and new.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class LocalServices:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.pid_dir = run_dir / "pids"
        self.pid_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        (self.pid_dir / f"{name}.pid").write_text(json.dumps({"pid": proc.pid, "module": argv[2]}))
        return proc

    def simulator(self, argv_tail: list[str], api_key: str) -> tuple[str, str]:
        """(url, key) of the run's simulator: the running one if it still answers, else a new one."""
        info = self.run_dir / "simulator.json"
        if info.exists():
            known = json.loads(info.read_text())
            try:
                urllib.request.urlopen(known["url"] + "/_sim/health", timeout=2).close()
                return known["url"], known["key"]
            except OSError:
                pass
        port_file = self.run_dir / "simulator.port"
        port_file.unlink(missing_ok=True)
        # the key goes in the environment: a command line is readable by every user of the host
        proc = self._spawn("simulator", [sys.executable, "-m", "simulator", "--host", "127.0.0.1", "--port", "0",
                                         "--port-file", str(port_file), *argv_tail],
                           os.environ | {"SIMULATOR_API_KEY": api_key})
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the provider simulator did not start; see {self.run_dir / 'simulator.log'}")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        info.write_text(json.dumps({"url": url, "key": api_key}))
        os.chmod(info, 0o600)
        return url, api_key

    def eval_workers(self, n: int, argv_tail: list[str], env: dict[str, str]) -> list[subprocess.Popen]:
        return [self._spawn(f"eval-worker-{i}-{os.getpid()}", [sys.executable, "-m", "eval_worker", *argv_tail], env)
                for i in range(n)]

    def stop_all(self) -> None:
        """Stop every service this run started, from any dispatcher process (checks the pid is still ours)."""
        for f in self.pid_dir.glob("*.pid"):
            rec = json.loads(f.read_text())
            try:
                cmdline = Path(f"/proc/{rec['pid']}/cmdline").read_bytes().split(b"\0")
                if rec["module"].encode() in cmdline:
                    os.killpg(rec["pid"], signal.SIGTERM)
            except (OSError, ProcessLookupError):
                pass
            f.unlink(missing_ok=True)
        (self.run_dir / "simulator.json").unlink(missing_ok=True)
