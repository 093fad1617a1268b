"""The report as one self-contained HTML file: the tables and the PNGs (embedded as data URIs), no other file."""

from __future__ import annotations

import base64
from decimal import Decimal
from pathlib import Path

import jinja2

from dispatcher.report.figures import RunFigures
from dispatcher.report.outputs import STATUS_ORDER
from dispatcher.report.stats import PairedDifference, PassAtK

_ENV = jinja2.Environment(loader=jinja2.PackageLoader("dispatcher.report", "templates"),
                          autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)


def usd(v: Decimal | None) -> str:
    return "–" if v is None else f"${v:.6f}"


def pct(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{100 * v:.{digits}f}%"


def signed_pct(v: float) -> str:
    return f"{100 * v:+.1f} pp"


def ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.0f} ms"


def secs(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} s"


def pass_at(f: RunFigures, k: int) -> PassAtK | None:
    return next((p for p in f.pass_at if p.k == k), None)


def render(runs: list[RunFigures], compare: PairedDifference | None, pngs: list[Path], path: Path) -> Path:
    title = f"{runs[0].run} against {runs[1].run}" if compare else f"Run {runs[0].run}"
    statuses = [s for s in STATUS_ORDER if any(f.statuses.get(s) for f in runs)]
    statuses += sorted({s for f in runs for s in f.statuses} - set(statuses))
    ks = sorted({p.k for f in runs for p in f.pass_at})
    images = [(p.stem, base64.b64encode(p.read_bytes()).decode()) for p in pngs]
    html = _ENV.get_template("report.html.j2").render(
        title=title, runs=runs, compare=compare, statuses=statuses, ks=ks, images=images, usd=usd, pct=pct,
        signed_pct=signed_pct, ms=ms, secs=secs, pass_at=pass_at)
    path.write_text(html)
    return path
