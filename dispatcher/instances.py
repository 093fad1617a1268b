"""Dataset loading: SWE-bench rows from .jsonl/.json/.parquet files or a known name, then ids/filter/slice."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "version", "FAIL_TO_PASS", "PASS_TO_PASS",
            "image", "eval_script", "log_parser", "eval_type")

# Known names -> files in the shared datasets folder (EVALPLANE_DATASETS_DIR overrides where it is).
KNOWN = {
    "swe-bench/swe-bench_verified": "SWE-bench_Verified_{split}.parquet",
    "verified": "SWE-bench_Verified_{split}.parquet",
    "swe-bench/swe-bench_lite": "SWE-bench_Lite_{split}.parquet",
    "lite": "SWE-bench_Lite_{split}.parquet",
    "synthetic": str(PROJECT_ROOT / "examples" / "synthetic" / "instances.jsonl"),
}


def datasets_dir() -> Path:
    return Path(os.environ.get("EVALPLANE_DATASETS_DIR", PROJECT_ROOT.parent / "shared" / "datasets"))


def resolve_dataset(name: str, base: str | None = None, split: str = "test") -> Path:
    """A dataset reference -> an existing file; ValueError naming what was tried."""
    p = Path(name)
    if not p.is_absolute():
        p = Path(base or ".") / p
    if p.is_file():
        return p.resolve()
    known = KNOWN.get(name.lower())
    if known:
        q = Path(known.format(split=split))
        q = q if q.is_absolute() else datasets_dir() / q
        if q.is_file():
            return q.resolve()
        raise ValueError(f"dataset {name!r} resolves to {q}, which does not exist")
    raise ValueError(f"dataset file not found: {p} (known names: {', '.join(sorted(KNOWN))})")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    return list(data.values()) if isinstance(data, dict) else data


def select(rows: list[dict], ids: list[str] | None = None, filter: dict | None = None, slice_: str | None = None) -> list[dict]:
    """Apply the spec's id list, field filter and slice, in that order. Unknown ids are an error."""
    if ids is not None:
        by_id = {r["instance_id"]: r for r in rows}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(f"instance ids not in the dataset: {', '.join(missing[:10])}"
                             + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
        rows = [by_id[i] for i in ids]
    for field, want in (filter or {}).items():
        wanted = {want} if isinstance(want, str) else set(want)
        rows = [r for r in rows if str(r.get(field)) in wanted]
    if slice_:
        a, _, b = slice_.partition(":")
        rows = rows[slice(int(a) if a else None, int(b) if b else None)]
    return rows


def check_rows(rows: list[dict]) -> list[str]:
    problems = []
    for r in rows:
        missing = [f for f in REQUIRED if f not in r]
        if missing:
            problems.append(f"{r.get('instance_id', '?')}: missing fields {', '.join(missing)}")
    return problems
