"""What an attempt's compute costs, from the figures its row records and the price table kept as data
(contract/prices/compute.toml, each rate with its source and date; $EVALPLANE_COMPUTE_PRICE_FILE for another).

    task    = vCPUs x task wall hours x vCPU-hour + GB (its memory limit: the size the task is provisioned at)
              x task wall hours x GB-hour            (Fargate bills a task's size, not its use, over its life),
              at the rates of the capacity it ran on (on demand or Spot, as its row says; else the table's)
    grading = grading wall hours x the eval host's instance-hour / the gradings a host runs at once
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PRICE_FILE_ENV = "EVALPLANE_COMPUTE_PRICE_FILE"
Capacity = Literal["on_demand", "spot"]
BUNDLED = Path(__file__).with_name("prices") / "compute.toml"


class _Rates(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    date: str


class TaskRates(_Rates):
    on_demand_vcpu_hour: float = Field(ge=0)
    on_demand_gb_hour: float = Field(ge=0)
    spot_vcpu_hour: float = Field(ge=0)
    spot_gb_hour: float = Field(ge=0)
    capacity: Capacity = "on_demand"  # what prices a task whose row does not say (local tasks, older rows)

    def rates(self, capacity: Capacity | None = None) -> tuple[float, float]:
        """(vCPU-hour, GB-hour) on that capacity (default: the table's)."""
        if (capacity or self.capacity) == "spot":
            return self.spot_vcpu_hour, self.spot_gb_hour
        return self.on_demand_vcpu_hour, self.on_demand_gb_hour


class GradingRates(_Rates):
    instance_type: str
    instance_hour: float = Field(ge=0)
    gradings_per_instance: int = Field(ge=1)


class RegistryRates(_Rates):
    gb_month: float = Field(ge=0)


class ComputeCost(BaseModel):
    """Unrounded: whoever shows or sums it rounds once (dispatcher.report.figures.usd_of, to the nano-dollar)."""

    task_usd: float | None  # None: the row does not record what it takes (resources or wall time)
    grading_usd: float | None  # None: never graded

    @property
    def total_usd(self) -> float:
        return (self.task_usd or 0.0) + (self.grading_usd or 0.0)


class ComputePrices(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    task: TaskRates
    grading: GradingRates
    registry: RegistryRates

    def task_usd(self, cpu: float | None, memory_limit_mib: float | None, wall_s: float | None,
                 capacity: Capacity | None = None) -> float | None:
        if cpu is None or memory_limit_mib is None or wall_s is None:
            return None
        hours, (vcpu_hour, gb_hour) = wall_s / 3600, self.task.rates(capacity)
        return cpu * hours * vcpu_hour + memory_limit_mib / 1024 * hours * gb_hour

    def grading_usd(self, wall_s: float | None) -> float | None:
        if wall_s is None:
            return None
        return wall_s / 3600 * self.grading.instance_hour / self.grading.gradings_per_instance

    def attempt(self, row: Mapping[str, Any]) -> ComputeCost:
        """The compute cost of an attempt row (its task_cpu, task_memory_limit_mib, task_wall_s, task_capacity,
        grading_wall_s)."""
        return ComputeCost(task_usd=self.task_usd(row.get("task_cpu"), row.get("task_memory_limit_mib"),
                                                  row.get("task_wall_s"), row.get("task_capacity")),
                           grading_usd=self.grading_usd(row.get("grading_wall_s")))


def price_file() -> Path:
    return Path(os.environ.get(PRICE_FILE_ENV) or BUNDLED)


@lru_cache(maxsize=4)
def _load(path: str) -> ComputePrices:
    return ComputePrices.model_validate(tomllib.loads(Path(path).read_text()))


def load(path: Path | None = None) -> ComputePrices:
    """The price table (raises pydantic's ValidationError naming the field of a bad one)."""
    return _load(str(path or price_file()))
