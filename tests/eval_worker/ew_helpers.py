"""Helpers for the eval worker tests (imported by name; the folder has no __init__.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from contract.models import AttemptRef, EvalJob

ROOT = Path(__file__).resolve().parents[2]
SYNTH = ROOT / "examples" / "synthetic"


def load_instances() -> dict[str, dict]:
    rows = [json.loads(line) for line in (SYNTH / "instances.jsonl").read_text().splitlines() if line.strip()]
    return {r["instance_id"]: r for r in rows}


def bundle_for(row: dict) -> str:
    return str(SYNTH / "repos" / f"{row['repo'].replace('/', '__')}.bundle")


def make_job(row: dict, *, run: str = "run1", attempt: int = 1, model: str = "evalplane/demo-model",
             timeout_s: float = 60.0, repo_source: str | None = None, **kw) -> EvalJob:
    iid = row["instance_id"]
    return EvalJob(
        ref=AttemptRef(run=run, instance_id=iid, attempt=attempt),
        model_name=model,
        patch_uri=kw.pop("patch_uri", f"s3://unused/{run}/{iid}/{attempt}/patch.diff"),
        instance=row,
        repo_source=repo_source or bundle_for(row),
        verdict_queue_url=kw.pop("verdict_queue_url", "http://unused/verdicts"),
        artifacts_prefix=kw.pop("artifacts_prefix", f"s3://unused/runs/{run}/attempts/{iid}/{attempt}/"),
        timeout_s=timeout_s,
        **kw,
    )


def patch_from_edits(row: dict, edits: list[tuple[str, str, str]], workdir: Path) -> str:
    """A unified git diff made by editing a fresh clone of the instance's repository at base."""
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    repo = workdir / f"edit-{row['instance_id']}"
    subprocess.run(["git", "clone", "-q", bundle_for(row), str(repo)], check=True, env=env)
    subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=repo, check=True, env=env)
    for path, old, new in edits:
        f = repo / path
        text = f.read_text()
        assert text.count(old) == 1, (path, old)
        f.write_text(text.replace(old, new))
    out = subprocess.run(["git", "diff"], cwd=repo, check=True, env=env, capture_output=True, text=True)
    return out.stdout
