"""ShimConfig: everything the shim needs, read from one JSON file (never the upstream key).

Validated by hand rather than with pydantic: the shim runs in every task and pydantic (with contract.models)
costs ~13 MB of RSS and ~0.1 s at start. The rules are the ones the pydantic model had: unknown fields are
refused, types are checked (ints also from integral floats, floats also from ints, paths from strings), and
the bounds below hold. `ref` and `limits` take dicts or any object with the same attributes (e.g.
contract.models.AttemptRef / AttemptLimits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UPSTREAM_KEY_ENV = "SHIM_UPSTREAM_KEY"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Ref:
    """contract.models.AttemptRef's fields (the ledger rows and Valkey keys use them)."""

    run: str
    instance_id: str
    attempt: int

    @property
    def slug(self) -> str:
        return f"{self.instance_id}/{self.attempt}"


@dataclass(frozen=True, slots=True)
class Limits:
    """contract.models.AttemptLimits' fields."""

    cost_usd: float | None = None
    max_turns: int | None = None
    wall_time_s: float | None = None


_REQUIRED = object()

_BATCH_SIZE_MAX = 200  # ledger rows per SQS message

# name: (type, default, constraint); type is one of str int float path bool, or a tuple of allowed strings;
# "?" after it = may be null. Constraint: (op, bound) with op in ge gt le minlen.
_FIELDS: dict[str, tuple[Any, Any, tuple[str, float] | None]] = {
    "listen_host": ("str", "127.0.0.1", None),
    "listen_port": ("int", 0, None),  # 0 = any free port
    "port_file": ("path?", None, None),  # the bound port is written here once the shim is ready
    "upstream_url": ("str", _REQUIRED, None),  # base URL; /v1/chat/completions and /v1/messages are appended
    "provider": (("openai", "anthropic"), _REQUIRED, None),
    "model": ("str", _REQUIRED, None),  # pinned: requests are forwarded with this model, and priced with it
    "pool": ("str", _REQUIRED, None),
    "ref": ("ref", _REQUIRED, None),
    "local_token": ("str", _REQUIRED, ("minlen", 1)),  # the only credential the harness holds
    "ledger_path": ("path", _REQUIRED, None),
    "valkey_url": ("str?", None, None),  # progress, budgets, discovered limits; None = local only
    "results_queue_url": ("str?", None, None),
    # ledger rows per SQS message, at most (a partial batch goes after batch_interval_s): each message costs the shim
    # a signed request in a thread. Side by side at c=16 and ~1,500 calls/s (bench/bench_shim.py's CPU workload), the
    # shim's CPU per call was 0.34 ms at 25 rows, 0.27 at 100 and 0.225 at 200 (against 0.245 in the same run); 200
    # rows of ~0.6 KB are ~120 KB, within SQS's 256 KiB (Ledger splits a batch that is not)
    "batch_size": ("int", _BATCH_SIZE_MAX, ("ge", 1)),
    "batch_interval_s": ("float", 2.0, ("gt", 0)),
    "limits": ("limits", None, None),
    "run_cost_usd": ("float?", None, None),
    "status_path": ("path?", None, None),
    # retries (429/529/503/overloaded)
    "max_attempts": ("int", 8, ("ge", 1)),  # upstream attempts per call, first one included
    "backoff_base_s": ("float", 0.5, ("ge", 0)),
    "backoff_cap_s": ("float", 30.0, ("ge", 0)),
    "max_retry_after_s": ("float", 60.0, ("ge", 0)),  # a longer retry-after is clipped to this
    # pool pacing (GCRA in Valkey against contract.keys.pool_limits; only with valkey_url)
    "pacer_burst_s": ("float", 60.0, ("gt", 0)),  # seconds of a limit usable at once (providers' buckets: 60)
    "pacer_max_wait_s": ("float", 60.0, ("gt", 0)),  # book at most this far ahead; beyond, sleep then book
    # timeouts
    "connect_timeout_s": ("float", 10.0, None),
    "sock_read_timeout_s": ("float", 120.0, None),
    "heartbeat_s": ("float", 30.0, ("gt", 0)),  # progress-key refresh while idle
    "hold_ttl_s": ("float", 1800.0, ("gt", 0)),  # a budget hold not settled by then is released
    # tickets (shim/gate.py): each call's settle takes the hold and pool booking of the next call ahead, so
    # that call asks Valkey nothing; an unused ticket is given back after ticket_ttl_s (0: no tickets)
    "ticket_ttl_s": ("float", 15.0, ("ge", 0)),
    # tickets only while the run's spent + held stays within this share of the run cap
    "ticket_room": ("float", 0.8, ("share", None)),
    # a lone call's bookkeeping (ledger row, settles, progress, the next ticket) waits this long after its
    # answer's end, so that the harness, which the answer has just woken, has the CPU first (0: at once)
    "finish_delay_s": ("float", 0.002, ("ge", 0)),
    # with the compiled data plane, while calls overlap: how long a call's `end` line waits to go to this process
    # with others' (its bookkeeping, as above, once it is here). Side by side at c=16 against an instant
    # simulator (bench/bench_shim.py's CPU workload), 20 ms took 10-16% less CPU per call than 2 ms; 50 ms, 3%
    # less again (noise). A lone call's waits finish_delay_s (at most 5 ms)
    "end_batch_s": ("float", 0.02, ("ge", 0)),
    "shutdown_timeout_s": ("float", 5.0, None),  # grace for in-flight calls on SIGTERM
    "sqs_flush_timeout_s": ("float", 30.0, None),  # how long shutdown keeps retrying SQS sends
    # false: at exit, rows not yet sent stay for the task, which sends them inside the attempt's result (one
    # message instead of two; the status file's unsent_seqs names them)
    "flush_on_exit": ("bool", True, None),
    "max_body_bytes": ("int", 32 << 20, ("ge", 1024)),  # larger requests get 413 (Anthropic's limit: 32 MB)
    "max_stream_buffer_bytes": ("int", 1 << 20, None),  # pre-content buffer (for transparent retries)
    # who serves the harness: "compiled" (shim/dataplane, with this process as its control plane: shim/front.py)
    # or "python" (shim/server.py alone). Compiled falls back to python, with a warning, for an https upstream or
    # where no shim_dataplane binary is built (scripts/build_dataplane.sh; the harness image has one)
    "dataplane": (("python", "compiled"), "compiled", None),
}


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool):
        raise ConfigError(f"{name}: expected an integer, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise ConfigError(f"{name}: expected an integer, got {v!r}")


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {v!r}")
    return float(v)


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{name}: expected a string, got {v!r}")
    return v


def _ref(v: Any) -> Ref:
    if isinstance(v, Ref):
        return v
    if isinstance(v, dict) and set(v) - {"run", "instance_id", "attempt"}:
        raise ConfigError(f"ref: unknown fields {sorted(set(v) - {'run', 'instance_id', 'attempt'})}")
    ref = Ref(_str("ref.run", _get(v, "run")), _str("ref.instance_id", _get(v, "instance_id")),
              _int("ref.attempt", _get(v, "attempt")))
    if ref.attempt < 1:
        raise ConfigError("ref.attempt: must be >= 1")
    return ref


def _limits(v: Any) -> Limits:
    if v is None:
        return Limits()
    if isinstance(v, Limits):
        return v
    if isinstance(v, dict) and set(v) - {"cost_usd", "max_turns", "wall_time_s"}:
        raise ConfigError(f"limits: unknown fields {sorted(set(v) - {'cost_usd', 'max_turns', 'wall_time_s'})}")
    c, t, w = _get(v, "cost_usd"), _get(v, "max_turns"), _get(v, "wall_time_s")
    return Limits(None if c is None else _float("limits.cost_usd", c), None if t is None else _int("limits.max_turns", t),
                  None if w is None else _float("limits.wall_time_s", w))


def _convert(name: str, kind: Any, v: Any) -> Any:
    if isinstance(kind, tuple):
        if v not in kind:
            raise ConfigError(f"{name}: expected one of {kind}, got {v!r}")
        return v
    if kind.endswith("?"):
        if v is None:
            return None
        kind = kind[:-1]
    if kind == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{name}: expected true or false, got {v!r}")
        return v
    if kind == "str":
        return _str(name, v)
    if kind == "int":
        return _int(name, v)
    if kind == "float":
        return _float(name, v)
    if kind == "path":
        if isinstance(v, Path):
            return v
        return Path(_str(name, v))
    if kind == "ref":
        return _ref(v)
    if kind == "limits":
        return _limits(v)
    raise AssertionError(kind)


class ShimConfig:
    """Attributes as in _FIELDS. ShimConfig(**fields), ShimConfig.model_validate(dict) or .model_validate_json(text)."""

    __slots__ = tuple(_FIELDS)

    # for type checkers and readers: the attributes
    listen_host: str
    listen_port: int
    port_file: Path | None
    upstream_url: str
    provider: str
    model: str
    pool: str
    ref: Ref
    local_token: str
    ledger_path: Path
    valkey_url: str | None
    results_queue_url: str | None
    batch_size: int
    batch_interval_s: float
    limits: Limits
    run_cost_usd: float | None
    status_path: Path | None
    max_attempts: int
    backoff_base_s: float
    backoff_cap_s: float
    max_retry_after_s: float
    pacer_burst_s: float
    pacer_max_wait_s: float
    connect_timeout_s: float
    sock_read_timeout_s: float
    heartbeat_s: float
    hold_ttl_s: float
    ticket_ttl_s: float
    ticket_room: float
    finish_delay_s: float
    end_batch_s: float
    shutdown_timeout_s: float
    sqs_flush_timeout_s: float
    flush_on_exit: bool
    max_body_bytes: int
    max_stream_buffer_bytes: int
    dataplane: str

    def __init__(self, **fields: Any):
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"unknown fields: {sorted(unknown)}")
        for name, (kind, default, bound) in _FIELDS.items():
            if name in fields:
                value = _convert(name, kind, fields[name])
            elif default is _REQUIRED:
                raise ConfigError(f"{name}: required")
            else:
                value = _convert(name, kind, default)
            if bound is not None and value is not None:
                op, b = bound
                if op == "ge" and not value >= b:
                    raise ConfigError(f"{name}: must be >= {b}")
                if op == "gt" and not value > b:
                    raise ConfigError(f"{name}: must be > {b}")
                if op == "share" and not 0 < value <= 1:
                    raise ConfigError(f"{name}: must be > 0 and <= 1")
                if op == "minlen" and len(value) < b:
                    raise ConfigError(f"{name}: must have at least {b} characters")
            object.__setattr__(self, name, value)
        if self.batch_size > _BATCH_SIZE_MAX:
            raise ConfigError(f"batch_size: must be <= {_BATCH_SIZE_MAX}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ShimConfig is read-only")

    @classmethod
    def model_validate(cls, data: Any) -> ShimConfig:
        if not isinstance(data, dict):
            raise ConfigError("the config must be a JSON object")
        return cls(**data)

    @classmethod
    def model_validate_json(cls, text: str | bytes) -> ShimConfig:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"not valid JSON: {e}") from e
        return cls.model_validate(data)

    def __repr__(self) -> str:
        return "ShimConfig(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in _FIELDS if k != "local_token") + ")"
