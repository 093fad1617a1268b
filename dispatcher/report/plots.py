"""The report's plots as PNG files (matplotlib, its object API: no pyplot state, no display needed).

Each plot takes one run or two (a comparison draws both on the same axes).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from matplotlib.figure import Figure

from dispatcher.report.figures import RunFigures, Series

COLORS = ("#2b6cb0", "#dd6b20")
STATUS_COLORS = {"RESOLVED": "#1f9d55", "UNRESOLVED": "#d64545", "EMPTY_PATCH": "#e0a800", "EVAL_ERROR": "#d97706",
                 "INFRA_ERROR": "#9b2c9b", "CANCELLED": "#a0aec0", "PATCH_READY": "#63b3ed", "missing": "#edf2f7"}

Run = tuple[RunFigures, Series]


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, object]:
    fig = Figure(figsize=(7.5, 4.2), dpi=110, layout="constrained")
    ax = fig.subplots()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _minutes(t: datetime, t0: datetime) -> float:
    return (t - t0).total_seconds() / 60


def resolved_vs_cost(runs: list[Run], path: Path) -> Path:
    """Resolved attempts against spend, attempts in the order they ended: how much each resolve cost."""
    fig, ax = _figure("Resolved against cost", "cumulative spend of the attempts ($, ledger)", "resolved attempts")
    for (f, _), color in zip(runs, COLORS):
        done = sorted((a for a in f.attempts if a.ended_at), key=lambda a: a.ended_at)
        xs, ys, hits, spend, resolved = [0.0], [0], [], 0.0, 0
        for a in done:
            spend += float(a.cost_usd)
            if a.status == "RESOLVED":
                resolved += 1
                hits.append((spend, resolved))
            xs.append(spend)
            ys.append(resolved)
        ax.step(xs, ys, where="post", color=color, label=f"{f.run} ({resolved} resolved, ${spend:.4f})")
        if hits:
            ax.scatter(*zip(*hits), color=color, s=14, zorder=3)
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path)
    return path


def spend_over_time(runs: list[Run], path: Path) -> Path:
    """The ledger's cumulative spend against minutes since the run started, with each run's cap."""
    fig, ax = _figure("Spend over time", "minutes since the run started", "cumulative spend ($, ledger)")
    for (f, s), color in zip(runs, COLORS):
        xs, ys, total = [0.0], [0.0], 0.0
        for t, cost in zip(s.call_end, s.call_cost):
            total += float(cost)
            xs.append(_minutes(t, f.created_at))
            ys.append(total)
        ax.step(xs, ys, where="post", color=color, label=f"{f.run} (${total:.4f})")
        if f.run_cap_usd is not None and total > 0.5 * float(f.run_cap_usd):  # the cap only where it is in view
            ax.axhline(float(f.run_cap_usd), color=color, linestyle="--", linewidth=1, label=f"{f.run} cap")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path)
    return path


def concurrency_over_time(runs: list[Run], path: Path) -> Path:
    """Attempts in their harness phase at each moment."""
    fig, ax = _figure("Concurrency over time", "minutes since the run started", "attempts running")
    for (f, s), color in zip(runs, COLORS):
        events = sorted([(a, 1) for a, _ in s.spans] + [(b, -1) for _, b in s.spans])
        xs, ys, level = [0.0], [0], 0
        for t, step in events:
            level += step
            xs.append(_minutes(t, f.created_at))
            ys.append(level)
        ax.step(xs, ys, where="post", color=color, label=f"{f.run} (peak {max(ys)})")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper right", fontsize=8)
    fig.savefig(path)
    return path


def instance_grid(a: RunFigures, b: RunFigures, path: Path) -> Path:
    """One row per instance of either run, one column of attempts per run, each cell its attempt's status."""
    ids = sorted({i.instance_id for i in a.instances_detail} | {i.instance_id for i in b.instances_detail})
    width = max([len(i.statuses) for i in a.instances_detail + b.instances_detail] or [1])
    by = [{i.instance_id: i.statuses for i in f.instances_detail} for f in (a, b)]
    fig = Figure(figsize=(2.0 + 0.5 * 2 * width + 3.0, 1.2 + 0.28 * len(ids)), dpi=110, layout="constrained")
    ax = fig.subplots()
    for row, iid in enumerate(ids):
        for col, statuses in enumerate(by):
            got = statuses.get(iid, [])
            for n in range(width):
                status = got[n] if n < len(got) else "missing"
                x = col * (width + 1) + n
                ax.add_patch(_cell(x, row, STATUS_COLORS.get(status, "#718096")))
    ax.set_xlim(-0.2, 2 * width + 1 - 0.8)
    ax.set_ylim(len(ids) - 0.2, -0.8)
    ax.set_yticks(range(len(ids)), ids, fontsize=8)
    ax.set_xticks([(width - 1) / 2, width + 1 + (width - 1) / 2], [a.run, b.run], fontsize=9)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title("Per instance: each attempt's status", fontsize=11)
    from matplotlib.patches import Patch

    shown = [s for s in STATUS_COLORS if any(s in v for st in by for v in st.values())]
    ax.legend(handles=[Patch(color=STATUS_COLORS[s], label=s.lower()) for s in shown],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.savefig(path)
    return path


def _cell(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.4, y - 0.4), 0.8, 0.8, color=color)
