"""The gateway tier on this host: `replicas` LiteLLM proxies (each on a port of its own) behind haproxy, which
health-checks them and sends each call to a live one. Detached daemons under <state>/gateway (pid files, logs), so
the tier outlives the dispatcher that started it, like moto; `stop` ends them from any process.

haproxy retries only a connection that failed before the request went out (its default), so a call a replica may
have forwarded is never sent twice by the balancer; the shim retries the 502 it gets for one cut mid-way.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import urllib.request
from pathlib import Path

import yaml
from pydantic import BaseModel

from gateway.config import MASTER_KEY_ENV, GatewaySettings, litellm_config
from plumbing.services import Service, free_port, recorded_pid, stop_recorded

PROJECT_ROOT = Path(__file__).resolve().parents[1]
HEALTH_PATH = "/health/liveliness"


class TierInfo(BaseModel):
    url: str
    replicas: dict[str, int]  # replica name -> its port
    database_url: str
    valkey_url: str


def folder(state_dir: Path) -> Path:
    d = state_dir / "gateway"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def provider_keys_file(state_dir: Path) -> Path:
    return folder(state_dir) / "provider-keys.json"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + HEALTH_PATH, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _secret_file(path: Path) -> str:
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("sk-" + secrets.token_hex(32))
    return path.read_text().strip()


def haproxy_config(port: int, replicas: dict[str, int]) -> str:
    # http-no-delay: else haproxy holds a stream's small first segments back to merge them (~200 ms to first byte)
    servers = "".join(f"  server {name} 127.0.0.1:{p} check\n" for name, p in replicas.items())
    return (
        "global\n  maxconn 4096\n"
        "defaults\n  mode http\n  timeout connect 5s\n  timeout client 900s\n  timeout server 900s\n"
        "  retries 3\n  option redispatch\n  option http-no-delay\n"
        f"frontend gateway\n  bind 127.0.0.1:{port}\n  default_backend litellm\n"
        "backend litellm\n  balance leastconn\n"
        f"  option httpchk GET {HEALTH_PATH}\n  http-check expect status 200\n"
        "  default-server inter 1s fall 2 rise 2\n" + servers
    )


def _litellm() -> list[str]:
    """LiteLLM's proxy command, run by this interpreter: its command line is then the recorded argv, which
    stop_recorded checks before it signals (a script's own would start with its shebang's interpreter)."""
    return [sys.executable, os.environ.get("EVALPLANE_LITELLM") or str(Path(sys.executable).parent / "litellm")]


def replica_service(d: Path, name: str, port: int, settings: GatewaySettings) -> Service:
    # DB-less: the replica must not see DATABASE_URL (LiteLLM would switch to its Prisma mode)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "VALKEY_URL")} | settings.env() | {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True", MASTER_KEY_ENV: _secret_file(d / "master.key"),
        "PYTHONPATH": str(PROJECT_ROOT)}
    return Service([*_litellm(), "--config", str(d / "litellm.yaml"), "--host", "127.0.0.1", "--port", str(port),
                    "--num_workers", "1"], name=f"gateway replica {name}", env=env, cwd=PROJECT_ROOT,
                   log=d / f"{name}.log", ready=lambda: _answers(f"http://127.0.0.1:{port}"), timeout_s=240,
                   poll_s=0.2, grace_s=10, new_session=True, pidfile=d / f"{name}.pid")


def ensure(state_dir: Path, database_url: str, valkey_url: str, replicas: int = 2) -> TierInfo:
    """The running tier if it answers (with this database and Valkey; a replica that died is started again on its
    port, which haproxy finds by its health check), else a new one."""
    d = folder(state_dir)
    info_file = d / "tier.json"

    def settings(name: str) -> GatewaySettings:
        return GatewaySettings(database_url=database_url, valkey_url=valkey_url,
                               provider_keys_file=provider_keys_file(state_dir), replica=name)

    if info_file.exists():
        info = TierInfo.model_validate_json(info_file.read_text())
        if (info.database_url, info.valkey_url) == (database_url, valkey_url) and _answers(info.url):
            dead = [replica_service(d, name, port, settings(name)).spawn() for name, port in info.replicas.items()
                    if recorded_pid(d / f"{name}.pid") is None]
            for s in dead:
                s.wait_ready()
            return info
        stop(state_dir)
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not os.path.exists(haproxy):
        raise RuntimeError("haproxy is not installed: scripts/stack.sh up installs it")
    (d / "litellm.yaml").write_text(yaml.safe_dump(litellm_config()))
    ports = {f"replica-{i}": free_port() for i in range(replicas)}
    services = [replica_service(d, name, port, settings(name)).spawn() for name, port in ports.items()]
    for s in services:  # started side by side: each takes seconds to import LiteLLM
        s.wait_ready()
    port = free_port()
    (d / "haproxy.cfg").write_text(haproxy_config(port, ports))
    url = f"http://127.0.0.1:{port}"
    Service([haproxy, "-db", "-f", str(d / "haproxy.cfg")], name="the gateway's haproxy", log=d / "haproxy.log",
            ready=lambda: _answers(url), timeout_s=30, poll_s=0.1, new_session=True, pidfile=d / "haproxy.pid").start()
    info = TierInfo(url=url, replicas=ports, database_url=database_url, valkey_url=valkey_url)
    info_file.write_text(info.model_dump_json())
    return info


def stop(state_dir: Path) -> bool:
    """Stop the tier's haproxy and replicas, if they run."""
    d = state_dir / "gateway"
    stopped = [stop_recorded(p) for p in sorted(d.glob("*.pid"))] if d.exists() else []
    (d / "tier.json").unlink(missing_ok=True)
    return any(stopped)


def running(state_dir: Path) -> TierInfo | None:
    f = state_dir / "gateway" / "tier.json"
    return TierInfo.model_validate_json(f.read_text()) if f.exists() else None

