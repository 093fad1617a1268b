"""The per-run local services of the local backend: the provider simulator and the eval workers.

They run in sessions of their own and their pids are recorded under the run's folder, so that a
killed dispatcher leaves them serving the tasks that are still running, a resumed dispatcher reuses
the simulator (same port, same key), and the run's end stops all of them, old and new.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from plumbing.services import Service, stop_recorded


class LocalServices:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.pid_dir = run_dir / "pids"
        self.pid_dir.mkdir(parents=True, exist_ok=True)

    def _service(self, name: str, what: str, argv: list[str], env: dict[str, str] | None, **ready) -> Service:
        """A detached service of the run (a session of its own, outliving this process): log <name>.log, pid
        recorded for stop_all()."""
        return Service(argv, name=what, env=env, log=self.run_dir / f"{name}.log", new_session=True,
                       pidfile=self.pid_dir / f"{name}.pid", **ready)

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
        # the key goes in the environment: a command line is readable by every user of the host
        port_file = self.run_dir / "simulator.port"
        sim = self._service("simulator", "the provider simulator",
                            [sys.executable, "-m", "simulator", "--host", "127.0.0.1", "--port", "0", "--port-file",
                             str(port_file), *argv_tail],
                            os.environ | {"SIMULATOR_API_KEY": api_key}, ready_file=port_file, poll_s=0.05).start()
        url = f"http://127.0.0.1:{sim.port}"
        info.write_text(json.dumps({"url": url, "key": api_key}))
        os.chmod(info, 0o600)
        return url, api_key

    def eval_workers(self, n: int, argv_tail: list[str], env: dict[str, str]) -> list[subprocess.Popen]:
        """n eval workers, running as soon as started (they take gradings from the queue when they are ready)."""
        return [self._service(f"eval-worker-{i}-{os.getpid()}", "an eval worker",
                              [sys.executable, "-m", "eval_worker", *argv_tail], env).spawn().proc for i in range(n)]

    def stop_all(self) -> None:
        """Stop every service this run started, from any dispatcher process (each only if its pid still runs it)."""
        for f in self.pid_dir.glob("*.pid"):
            stop_recorded(f)
        (self.run_dir / "simulator.json").unlink(missing_ok=True)
