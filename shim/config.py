"""ShimConfig: everything the shim needs, from one JSON file. Never a secret: the upstream key comes from
$SHIM_UPSTREAM_KEY, the run's Valkey user from contract.valkey_auth's variables, the attempt key (ledger batches are
signed with it) from contract.signing.ATTEMPT_KEY_ENV, all in the shim's environment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from contract import signing, valkey_auth
from contract.models import AttemptLimits, AttemptRef

UPSTREAM_KEY_ENV = "SHIM_UPSTREAM_KEY"
ConfigError = ValidationError  # what a bad config raises (each error names its field)


def _number(v: object) -> object:
    """Numbers only: pydantic would otherwise take "80" or true for a number."""
    if isinstance(v, (bool, str)):
        raise ValueError("expected a number")  # noqa: TRY004 - pydantic reports a ValueError as the field's error
    return v


Int = Annotated[int, BeforeValidator(_number)]
Float = Annotated[float, BeforeValidator(_number)]


class ShimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    listen_host: str = "127.0.0.1"
    listen_port: Int = 0  # 0: any free port
    port_file: Path | None = None  # the bound port is written here once the shim is ready
    upstream_url: str  # base URL; /v1/chat/completions, /v1/responses and /v1/messages are appended
    provider: Literal["openai", "anthropic"]
    model: str  # pinned: requests are forwarded with this model (or upstream_model), and priced with it
    upstream_model: str | None = None  # the name requests go upstream as: the gateway's alias for the pool
    pool: str
    ref: AttemptRef
    local_token: str = Field(min_length=1)  # the only credential the harness holds
    ledger_path: Path
    valkey_url: str | None = None  # progress, budgets, pacing, discovered limits; None = local only
    results_queue_url: str | None = None
    batch_size: Int = Field(200, ge=1, le=200)  # ledger rows per SQS message, at most
    batch_interval_s: Float = Field(2.0, gt=0)  # a partial batch goes after this long
    limits: AttemptLimits = AttemptLimits()
    run_cost_usd: Float | None = None
    status_path: Path | None = None
    # retries (429/529/503/overloaded/unreachable): when they run out, the session ends as rate_limited
    max_attempts: Int = Field(8, ge=1)  # upstream attempts per call, the first one included
    backoff_base_s: Float = Field(0.5, ge=0)
    backoff_cap_s: Float = Field(30.0, ge=0)
    max_retry_after_s: Float = Field(60.0, ge=0)  # a longer retry-after is clipped to this
    # pool pacing (GCRA in Valkey against contract.keys.pool_limits; only with valkey_url)
    pacer_burst_s: Float = Field(60.0, gt=0)  # seconds of a limit usable at once (providers' buckets: 60)
    pacer_max_wait_s: Float = Field(60.0, gt=0)  # book at most this far ahead; beyond, sleep then book
    # the pool's outage breaker (shim/breaker.py; only with valkey_url): a streak of breaker_failures upstream
    # failures (unreachable, 5xx, overloaded) over breaker_window_s with no success trips it; new calls are then
    # held, one goes as a probe every breaker_probe_s, and limits.outage_bound_s ends the attempt
    breaker_failures: Int = Field(5, ge=1)  # (the breaker is on only with limits.outage_bound_s)
    breaker_window_s: Float = Field(10.0, ge=0)
    breaker_probe_s: Float = Field(5.0, gt=0)
    breaker_poll_s: Float = Field(1.0, ge=0)  # how stale a held call's view of the breaker may be
    hold_poll_s: Float = Field(1.0, ge=0)  # how stale a call's view of the run's call hold (shim/hold.py) may be
    connect_timeout_s: Float = 10.0
    sock_read_timeout_s: Float = 120.0  # an upstream silent this long has failed
    heartbeat_s: Float = Field(30.0, gt=0)  # progress-key refresh while idle
    hold_ttl_s: Float = Field(1800.0, gt=0)  # a budget hold not settled by then is released
    store_wait_s: Float = Field(30.0, ge=0)  # a call's budget hold is asked again this long while Valkey fails
    shutdown_timeout_s: Float = 5.0  # grace for in-flight calls on SIGTERM
    sqs_flush_timeout_s: Float = 30.0  # how long shutdown keeps retrying SQS sends
    # false: at exit, rows not yet sent stay for the task, which sends them inside the attempt's result
    # (the status file's unsent_seqs names them)
    flush_on_exit: bool = True
    max_body_bytes: Int = Field(32 << 20, ge=1024)  # larger requests get 413 (Anthropic's limit: 32 MB)
    max_stream_buffer_bytes: Int = 1 << 20  # a stream's events held before its first content, at most

    @property
    def valkey_connect_url(self) -> str | None:
        """valkey_url as the run's Valkey user, whose name and password are in the environment."""
        return valkey_auth.with_credentials(self.valkey_url) if self.valkey_url else None


def ledger_signer() -> signing.Signer | None:
    """What ledger batches are signed with: the attempt's key, from the environment (None: unsigned, and the
    results writer will refuse them)."""
    key = signing.key_from_env(signing.ATTEMPT_KEY_ENV)
    return signing.signer(key) if key else None
