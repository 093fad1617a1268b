"""What the simulator billed and refused, per model: the ground truth tests compare ledgers with."""

from __future__ import annotations

from collections import defaultdict

from pydantic import BaseModel, Field

from simulator.tokens import Billing


class ModelStats(BaseModel):
    requests: int = 0  # every request that reached the model (authenticated and well-formed)
    input_tokens: int = 0  # uncached input
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    errors: dict[int, int] = Field(default_factory=dict)  # HTTP status -> responses sent
    stream_errors: int = 0  # streams that ended in `event: error`
    stream_cuts: int = 0  # streams cut half-way
    outage: int = 0  # requests failed by an outage (/_sim/outage), apart from `errors`


class Stats:
    def __init__(self) -> None:
        self._models: defaultdict[str, ModelStats] = defaultdict(ModelStats)

    def model(self, name: str) -> ModelStats:
        return self._models[name]

    def error(self, name: str, status: int) -> None:
        errors = self._models[name].errors
        errors[status] = errors.get(status, 0) + 1

    def bill(self, name: str, billing: Billing) -> None:
        stats = self._models[name]
        stats.input_tokens += billing.input_tokens
        stats.cached_tokens += billing.cached_tokens
        stats.cache_write_tokens += billing.cache_write_tokens
        stats.output_tokens += billing.output_tokens

    def as_json(self) -> dict:
        return {"models": {name: s.model_dump(mode="json") for name, s in self._models.items()}}

    def clear(self) -> None:
        self._models.clear()
