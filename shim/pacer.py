"""The seam for pool pacing (GCRA admission against pool limits; a later issue).

The shim calls `admit` before each upstream attempt and `settle` after it with the actual usage.
`NoopPacer` admits at once; a Valkey GCRA pacer (contract.keys.pool_pacer) will slot in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from contract.models import Usage


@dataclass(frozen=True, slots=True)
class PaceRequest:
    pool: str
    est_input_tokens: int  # uncached estimate
    max_output_tokens: int


class Pacer(Protocol):
    async def admit(self, req: PaceRequest) -> float:
        """Wait until the pool can take the call; return the time waited in ms."""

    async def settle(self, req: PaceRequest, actual: Usage | None, status: int, retry_after_s: float | None) -> None:
        """Reconcile the reservation with what the call used (None: the attempt failed)."""


class NoopPacer:
    async def admit(self, req: PaceRequest) -> float:
        return 0.0

    async def settle(self, req: PaceRequest, actual: Usage | None, status: int, retry_after_s: float | None) -> None:
        return None
