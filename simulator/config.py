"""The simulator's configuration: one pydantic model, also the single source of the CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SimulatorConfig(BaseModel):
    """Everything that shapes the simulator's behaviour. A limit of 0 switches that dimension off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: str | None = Field(None, description="accept only this key; unset = any non-empty key")
    rpm: int = Field(10_000, ge=0, description="requests per minute, per model, both routes (0 = no limit)")
    tpm: int = Field(30_000_000, ge=0, description="OpenAI tokens per minute (input + max_tokens)")
    itpm: int = Field(2_000_000, ge=0, description="Anthropic input tokens per minute (cache reads free)")
    otpm: int = Field(400_000, ge=0, description="Anthropic output tokens per minute")
    error_rate: float = Field(0.0, ge=0, le=1, description="fraction of requests answered with an error")
    error_statuses: list[int] = Field(
        [429, 529, 503], min_length=1, description="statuses to inject, e.g. 429,529"
    )
    stream_error_rate: float = Field(
        0.0, ge=0, le=1, description="fraction of streams ending in `event: error`"
    )
    stream_cut_rate: float = Field(0.0, ge=0, le=1, description="fraction of streams cut half-way")
    seed: int | None = Field(None, description="seed for the fault dice")
    outage_at_s: float | None = Field(None, ge=0, description=(
        "a provider outage starting this many seconds after start-up (also set live: POST /_sim/outage)"))
    outage_s: float = Field(0.0, ge=0, description="how long the outage lasts")
    outage_after_calls: int | None = Field(None, ge=0, description=(
        "start the outage (outage_s long) at the request after this many instead: inside a run, whatever its start-up "
        "took"))
    outage_status: int = Field(503, description=(
        "what every call gets during the outage: an HTTP status (503, 529, 500...), or 0 to drop the connection "
        "unanswered (as a provider that cannot be reached)"))
    ttft_ms: float = Field(0.0, ge=0, description="time to first token")
    tokens_per_s: float = Field(0.0, ge=0, description="output pace (0 = instant)")
    policy: str = Field("echo", description=(
        "`echo`, `judge`, `trajectory` (an agent's call shape, seeded by --seed) or a path to a JSON demo policy file"))
    dataset: Path | None = Field(None, description="SWE-bench .jsonl for the demo policy")
    red_team: Path | None = Field(None, description=(
        "intel JSON for the red-team policy (simulator/red_team.py): attack the task, one attack a turn, before "
        "the demo policy's script"))
    cache_prompts: int = Field(100_000, ge=1, description="prompts kept for prompt caching (LRU)")
    report_timing: bool = Field(
        False,
        description="stamp answers with the simulator's monotonic clock (time.perf_counter): headers "
        "x-simulator-arrived (the request reached the handler) and x-simulator-sent (the answer or a stream's "
        "head was sent); in streams an SSE comment `: sent=T` before each paced event and before the last "
        "one. For benches on one machine: the time a call spent outside the simulator.",
    )

    @field_validator("error_statuses", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [int(part) for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _demo_needs_dataset(self) -> SimulatorConfig:
        if self.policy not in ("echo", "judge", "trajectory") and self.dataset is None:
            raise ValueError("a demo policy file needs --dataset")
        return self

    def to_argv(self) -> list[str]:
        """The CLI flags that rebuild this config (for running it as a subprocess)."""
        argv: list[str] = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            argv += [flag(name), text]
        return argv


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")
