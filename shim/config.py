"""ShimConfig: everything the shim needs, read from one JSON file (never the upstream key)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.models import AttemptLimits, AttemptRef

UPSTREAM_KEY_ENV = "SHIM_UPSTREAM_KEY"


class ShimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0 = any free port
    port_file: Path | None = None  # the bound port is written here once the shim is ready

    upstream_url: str  # base URL; /v1/chat/completions and /v1/messages are appended
    provider: Literal["openai", "anthropic"]
    model: str  # pinned: requests are forwarded with this model, and priced with it
    pool: str
    ref: AttemptRef
    local_token: str = Field(min_length=1)  # the only credential the harness holds

    ledger_path: Path
    valkey_url: str | None = None  # progress, budgets, discovered limits; None = local only
    results_queue_url: str | None = None
    batch_size: int = Field(25, ge=1, le=200)
    batch_interval_s: float = Field(2.0, gt=0)

    limits: AttemptLimits = Field(default_factory=AttemptLimits)
    run_cost_usd: float | None = None
    status_path: Path | None = None

    # retries (429/529/503/overloaded)
    max_attempts: int = Field(8, ge=1)  # upstream attempts per call, first one included
    backoff_base_s: float = Field(0.5, ge=0)
    backoff_cap_s: float = Field(30.0, ge=0)
    max_retry_after_s: float = Field(60.0, ge=0)  # a longer retry-after is clipped to this

    # pool pacing (GCRA in Valkey against contract.keys.pool_limits; only with valkey_url)
    pacer_burst_s: float = Field(60.0, gt=0)  # seconds of a limit usable at once (providers' buckets hold 60)
    pacer_max_wait_s: float = Field(60.0, gt=0)  # book at most this far ahead; beyond, sleep then book

    # timeouts
    connect_timeout_s: float = 10.0
    sock_read_timeout_s: float = 120.0

    heartbeat_s: float = Field(30.0, gt=0)  # progress-key refresh while idle
    hold_ttl_s: float = Field(1800.0, gt=0)  # a budget hold not settled by then is released
    shutdown_timeout_s: float = 5.0  # grace for in-flight calls on SIGTERM
    sqs_flush_timeout_s: float = 30.0  # how long shutdown keeps retrying SQS sends
    max_body_bytes: int = Field(32 << 20, ge=1024)  # larger requests get 413 (Anthropic's own limit is 32 MB)
    max_stream_buffer_bytes: int = 1 << 20  # pre-content buffer (for transparent retries)
