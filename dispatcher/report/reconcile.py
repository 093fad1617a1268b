"""The run's meters side by side: the shim's ledger and the gateway's rows (gateway/meter.py), call by call on the
gateway's call id, and every call on which they differ (one meter has no row for it, or its tokens or cost differ
beyond rounding); and, where the run had a provider key of its own (dispatcher/provider_keys), the provider's usage
of that key, which can only be compared in total."""

from __future__ import annotations

import psycopg
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from contract.models import Totals, Usage
from dispatcher import store
from dispatcher.provider_keys import PROVIDER_KEYS

TOKENS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")
COST_TOLERANCE_USD = 1e-9  # both meters store cost as numeric(18, 9)


def _add(totals: Totals, row: dict, prefix: str) -> None:
    totals.add(Usage(**{t: row[prefix + t] for t in TOKENS}), float(row[prefix + "cost_usd"]))


class Difference(BaseModel):
    shim_call_id: str | None
    gateway_call_id: str | None
    what: str


class Reconciliation(BaseModel):
    run: str
    shim: Totals
    gateway: Totals
    provider: Totals | None = None  # the run's provider key's usage, as recorded when the run ended
    provider_key: str | None = None
    provider_counts_calls: bool = True  # False: the provider reports the key's cost only (OpenRouter)
    differences: list[Difference]

    @property
    def through_gateway(self) -> bool:
        return self.gateway.calls > 0 or any(d.gateway_call_id for d in self.differences)

    @property
    def agree(self) -> bool:
        return not self.differences

    def summary(self) -> dict:
        """The official report's extra key `meters`: whether the meters agree, how many calls differ, each total."""
        return {"agree": self.agree, "differences": len(self.differences), "shim": self.shim.model_dump(),
                "provider_counts_calls": self.provider_counts_calls,
                "gateway": self.gateway.model_dump(),
                "provider": None if self.provider is None else self.provider.model_dump()}

    def caption(self) -> str:
        meters = "shim, gateway" + (" and provider" if self.provider is not None else "")
        return (f"meters ({meters}) agree" if self.agree else
                f"[bold red]METERS DISAGREE[/]: {len(self.differences)} differences ({meters}; `report {self.run}`"
                " lists them)")


def _difference(row: dict) -> str | None:
    if row["shim_call_id"] is None:
        call, _, attempt = row["g_gateway_call_id"].rpartition(":")  # the shim names its attempts <call id>:<n>
        return (f"attempt {attempt} of shim call {call}: answered, lost on its way back and asked again (billed"
                " twice)" if call else "the gateway served it; no shim row")
    if row["g_gateway_call_id"] is None:
        return ("no gateway call id on the shim row" if row["shim_gateway_call_id"] is None
                else "no gateway row for the shim row's call id")
    diffs = [f"{t} {row['shim_' + t]} vs {row['g_' + t]}" for t in TOKENS if row["shim_" + t] != row["g_" + t]]
    if abs(float(row["shim_cost_usd"]) - float(row["g_cost_usd"])) > COST_TOLERANCE_USD:
        diffs.append(f"cost ${float(row['shim_cost_usd']):.9f} vs ${float(row['g_cost_usd']):.9f}")
    return "; ".join(diffs) or None


def provider_differences(provider: Totals, gateway: Totals, counts_calls: bool) -> list[str]:
    """How the provider's usage of the run's key differs from the gateway's rows, in total: calls, tokens by kind
    (where the provider counts them) and cost, beyond rounding (each row's cost is rounded once)."""
    off = [f"{k} {getattr(provider, k)} vs {getattr(gateway, k)}" for k in ("calls", *TOKENS)
           if counts_calls and getattr(provider, k) != getattr(gateway, k)]
    if abs(provider.cost_usd - gateway.cost_usd) > COST_TOLERANCE_USD * max(gateway.calls, 1):
        off.append(f"cost ${provider.cost_usd:.9f} vs ${gateway.cost_usd:.9f}")
    return off


def reconcile(conn: psycopg.Connection, run: str) -> Reconciliation:
    shim, gateway, differences = Totals(), Totals(), []
    for row in store.meter_pairs(conn, run):
        if row["shim_call_id"] is not None:
            _add(shim, row, "shim_")
        if row["g_gateway_call_id"] is not None:
            _add(gateway, row, "g_")
        if (what := _difference(row)) is not None:
            differences.append(Difference(shim_call_id=row["shim_call_id"],
                                          gateway_call_id=row["g_gateway_call_id"] or row["shim_gateway_call_id"],
                                          what=what))
    provider, key_id, counts_calls = None, None, True
    if (pk := store.provider_key(conn, run)) is not None and pk.usage is not None:
        provider, key_id = Totals.model_validate(pk.usage), pk.key_id
        counts_calls = PROVIDER_KEYS.get(pk.provider).counts_calls
        if off := provider_differences(provider, gateway, counts_calls):
            differences.append(Difference(shim_call_id=None, gateway_call_id=None,
                                          what=f"provider key {key_id} vs the gateway, in total: " + "; ".join(off)))
    return Reconciliation(run=run, shim=shim, gateway=gateway, provider=provider, provider_key=key_id,
                          provider_counts_calls=counts_calls, differences=differences)


def print_reconciliation(console: Console, r: Reconciliation, limit: int = 50) -> None:
    t = Table(title=f"meters of {r.run}: shim ledger vs gateway" + (" vs provider" if r.provider else ""))
    for c in ("meter", "calls", "input", "cached", "cache write", "output", "cost"):
        t.add_column(c, justify="left" if c == "meter" else "right")
    meters = [("shim ledger", r.shim), ("gateway", r.gateway)]
    if r.provider is not None:
        meters.append((f"provider (key {r.provider_key})", r.provider))
    for name, m in meters:
        counted = m is not r.provider or r.provider_counts_calls
        t.add_row(name, *(str(getattr(m, k)) if counted else "–" for k in ("calls", *TOKENS)), f"${m.cost_usd:.6f}")
    console.print(t)
    console.print(f"calls that differ: {len(r.differences)}", soft_wrap=True)
    for d in r.differences[:limit]:
        console.print(f"  shim {d.shim_call_id or '-'}  gateway {d.gateway_call_id or '-'}: {d.what}", soft_wrap=True)
    if len(r.differences) > limit:
        console.print(f"  ... and {len(r.differences) - limit} more")
