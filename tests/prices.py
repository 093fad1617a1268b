"""The compute price of an attempt row, worked out here from the price table's own words (contract/prices/
compute.toml read as TOML), so that a test checks contract.compute_prices rather than reusing it."""

from __future__ import annotations

import tomllib
from decimal import Decimal
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "contract" / "prices" / "compute.toml"


def priced(row: dict) -> Decimal:
    """task_cpu x task wall hours x vCPU-hour + memory limit GB x task wall hours x GB-hour (the rates of the
    capacity the row records, else the table's), plus the grading's wall hours x the eval host's hour / the gradings
    it runs at once."""
    table = tomllib.loads(TABLE.read_text())
    task, grading = table["task"], table["grading"]
    cap = row.get("task_capacity") or task["capacity"]
    hours = row["task_wall_s"] / 3600
    usd = (row["task_cpu"] * hours * task[f"{cap}_vcpu_hour"]
           + row["task_memory_limit_mib"] / 1024 * hours * task[f"{cap}_gb_hour"])
    if row["grading_wall_s"] is not None:
        usd += row["grading_wall_s"] / 3600 * grading["instance_hour"] / grading["gradings_per_instance"]
    return Decimal(str(round(usd, 9)))
