"""Valkey credentials: the admin URL the dispatcher uses, and the per-run users tasks get.

Locally, scripts/stack.sh runs the project's own server with no default user and an admin whose URL it writes
(0600) to .state/valkey/admin.url; VALKEY_URL overrides it. Each run gets its own ACL user (`run_user`) that can
touch only that run's keys and its pool's pacing keys (pacer, limits, discovered, breaker), and read its call hold;
tasks receive that user's name and password in their environment (USER_ENV, PASSWORD_ENV), never the admin's. On AWS the same two variables
come from Secrets Manager through the harness task definition (an ElastiCache RBAC user).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from contract import keys

USER_ENV = "EVALPLANE_VALKEY_USER"
PASSWORD_ENV = "EVALPLANE_VALKEY_PASSWORD"
ADMIN_URL_FILE = Path("valkey") / "admin.url"  # under the state folder (scripts/stack.sh writes it)


def _state_dir() -> Path:
    root = Path(__file__).resolve().parent.parent
    return Path(os.environ.get("EVALPLANE_STATE_DIR", root / ".state"))


def default_url() -> str:
    """VALKEY_URL (with the user of USER_ENV/PASSWORD_ENV if it names none: the judge's ECS task), else the project's
    own server's admin URL (scripts/stack.sh up)."""
    if url := os.environ.get("VALKEY_URL"):
        return with_credentials(url)
    f = _state_dir() / ADMIN_URL_FILE
    if f.exists():
        return f.read_text().strip()
    raise RuntimeError(f"VALKEY_URL is not set and {f} does not exist: run scripts/stack.sh up")


def has_credentials(url: str) -> bool:
    return bool(urlsplit(url).password)


def with_credentials(url: str, user: str | None = None, password: str | None = None) -> str:
    """`url` with a user and password: those given, else USER_ENV/PASSWORD_ENV's; unchanged if neither is set or
    the URL already carries credentials."""
    user = user if user is not None else os.environ.get(USER_ENV)
    password = password if password is not None else os.environ.get(PASSWORD_ENV)
    u = urlsplit(url)
    if not password or u.password:
        return url
    host = u.hostname or ""
    netloc = f"{quote(user or '', safe='')}:{quote(password, safe='')}@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def without_credentials(url: str) -> str:
    u = urlsplit(url)
    netloc = (u.hostname or "") + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def run_user(run: str) -> str:
    return f"ep-run-{run}"


def _glob(text: str) -> str:
    """A literal inside an ACL key pattern (glob): run and pool names are taken as they are."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def task_rules(run_glob: str, pool_glob: str) -> list[str]:
    """What a task's user may do (ACL rules): the keys of the runs matching run_glob, and the pacer state, discovered
    headers, outage breaker and limits of the pools matching pool_glob (the limits are the PoolPacer's, but the shim's admission
    script declares them, and a script's declared keys need write access); the runs' call holds, to read only; no
    other key (not the PoolPacer's own state, not the dashboard's). Commands: data and scripts; no admin, no key enumeration, no flushing of scripts.
    Locally the globs are one run's and one pool's names; the estate's harness user has "*" for both."""
    at = "\0"
    run_keys = keys.run_budget(at).removesuffix("budget").replace(at, run_glob) + "*"  # ep:run:{<run>}:*
    return [
        "resetchannels", f"~{run_keys}",
        f"~{keys.pool_pacer(at).replace(at, pool_glob)}", f"~{keys.pool_discovered(at).replace(at, pool_glob)}",
        f"~{keys.pool_limits(at).replace(at, pool_glob)}", f"~{keys.pool_breaker(at).replace(at, pool_glob)}",
        f"%R~{keys.run_hold(at).replace(at, run_glob)}",  # the run's call hold: read, never lifted by a task
        "-@all", "+@read", "+@write", "+@keyspace", "+@hash", "+@string", "+@transaction", "+@scripting",
        "+@connection", "+time",
        "-@admin", "-@dangerous", "-scan", "-script|flush", "-script|kill", "-function", "-select", "-swapdb",
    ]


def run_user_rules(run: str, pool: str, password: str) -> list[str]:
    """ACL SETUSER rules of one run's user: task_rules for exactly that run and pool, with its password."""
    return ["reset", "on", f">{password}", *task_rules(_glob(run), _glob(pool))]


def ensure_run_user(admin, run: str, pool: str, password: str) -> str:
    """Create (or reset to the same rules) the run's user, with the admin connection. Returns its name."""
    name = run_user(run)
    admin.execute_command("ACL", "SETUSER", name, *run_user_rules(run, pool, password))
    return name


def remove_run_user(admin, run: str) -> None:
    admin.execute_command("ACL", "DELUSER", run_user(run))
