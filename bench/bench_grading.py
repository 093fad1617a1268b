#!/usr/bin/env python3
"""Docker grading overhead and throughput, measured on this machine (prints measured numbers only).

Instance: evalplane__calc-1 on its SWE-bench-shaped image (images/swebench/build.py), graded with its
gold patch plus a 20 s sleep at import of calc.stats, so the instance's tests take about 20 s. Each
grading goes through the unmodified official run_instance (eval_worker.docker_backend).

  ratio     grading wall time / raw eval-script time; the raw time is run_instance's own
            "Test runtime" for /bin/bash /eval.sh, i.e. the same container in the same run
  overhead  wall - raw: container create/start, copy, patch apply, git diffs, grading, cleanup
  throughput  gradings per minute with 1 and with 2 worker processes (each grades one at a time)

  python bench/bench_grading.py [--jobs 4] [--sleep 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IID = "evalplane__calc-1"
MODEL = "bench"


def slow_patch(row: dict, sleep_s: float, workdir: Path) -> str:
    repo = workdir / "repo"
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    bundle = ROOT / "examples" / "synthetic" / "repos" / "evalplane__calc.bundle"
    subprocess.run(["git", "clone", "-q", str(bundle), str(repo)], check=True, env=env)
    subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=repo, check=True, env=env)  # history goes on
    subprocess.run(["git", "apply", "-"], input=row["patch"], text=True, cwd=repo, check=True, env=env)
    f = repo / "calc" / "stats.py"
    f.write_text(f.read_text().replace("def median(values):\n", f"import time as _t\n_t.sleep({sleep_s})\n\n\n"
                                       "def median(values):\n", 1))
    return subprocess.run(["git", "diff"], cwd=repo, check=True, env=env, capture_output=True, text=True).stdout


def grade_one(args: tuple[dict, str, str, str]) -> tuple[float, float, str]:
    """(wall s, raw eval-script s, outcome) for one grading."""
    from contract.models import AttemptRef, EvalJob
    from eval_worker.grading import grade
    from eval_worker.layout import instance_log_dir

    row, patch, run, logs_root = args
    job = EvalJob(ref=AttemptRef(run=run, instance_id=IID, attempt=1), model_name=MODEL, patch_uri="bench:",
                  instance=row, repo_source="", results_queue_url="bench:", artifacts_prefix="bench:",
                  timeout_s=600)
    backend = _backend()
    t0 = time.monotonic()
    v = grade(job, patch, logs_root, backend)
    wall = time.monotonic() - t0
    log = (instance_log_dir(logs_root, run, 1, MODEL, IID) / "run_instance.log").read_text()
    raw = float(re.search(r"Test runtime: ([\d_.]+) seconds", log).group(1).replace("_", ""))
    return wall, raw, v.outcome.value


_BACKEND = None


def _backend():
    global _BACKEND
    if _BACKEND is None:
        from eval_worker.docker_backend import DockerGrader

        _BACKEND = DockerGrader()
        _BACKEND.client.ping()
    return _BACKEND


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4, help="gradings per throughput measurement")
    ap.add_argument("--sleep", type=float, default=20.0, help="seconds the instance's tests sleep")
    args = ap.parse_args()

    from eval_worker.images import build_images, load_rows

    row = load_rows(ROOT / "examples" / "synthetic" / "instances.jsonl", [IID])[0]
    build_images([row], repos_dir=ROOT / "examples" / "synthetic" / "repos")
    with tempfile.TemporaryDirectory(prefix="ep-bench-") as tmp:
        tmp = Path(tmp)
        patch = slow_patch(row, args.sleep, tmp)
        tag = uuid.uuid4().hex[:6]
        grade_one((row, patch, f"bench-{tag}-warm", str(tmp / "logs")))  # warm-up, not reported

        t0 = time.monotonic()
        one = [grade_one((row, patch, f"bench-{tag}-w1-{i}", str(tmp / "logs"))) for i in range(args.jobs)]
        t1 = time.monotonic() - t0
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(2) as pool:
            pool.map(_backend_ready, range(2))  # start both workers before timing
            t0 = time.monotonic()
            two = pool.map(grade_one, [(row, patch, f"bench-{tag}-w2-{i}", str(tmp / "logs"))
                                       for i in range(args.jobs)], chunksize=1)
            t2 = time.monotonic() - t0

    assert all(o == "resolved" for _, _, o in one + two), (one, two)
    print(f"instance: {IID} (gold patch + {args.sleep:g} s sleep in the tests), docker backend, official run_instance")
    print("per grading (1 worker):  wall_s  eval_script_s  ratio  overhead_s")
    for wall, raw, _ in one:
        print(f"                         {wall:6.2f}  {raw:13.2f}  {wall / raw:5.3f}  {wall - raw:10.2f}")
    ratios = [w / r for w, r, _ in one]
    overheads = [w - r for w, r, _ in one]
    print(f"ratio wall/eval-script:  median {statistics.median(ratios):.3f}  max {max(ratios):.3f}")
    print(f"fixed overhead per instance: median {statistics.median(overheads):.2f} s  max {max(overheads):.2f} s")
    print(f"throughput, 1 worker:  {args.jobs} gradings in {t1:.1f} s = {args.jobs / t1 * 60:.2f} /min")
    print(f"throughput, 2 workers: {args.jobs} gradings in {t2:.1f} s = {args.jobs / t2 * 60:.2f} /min")
    print(f"  (2-worker per-grading wall: median {statistics.median(w for w, _, _ in two):.2f} s)")
    return 0


def _backend_ready(_: int) -> bool:
    _backend()
    import swebench.harness.run_evaluation  # noqa: F401  (import cost outside the timed section)
    return True


if __name__ == "__main__":
    sys.exit(main())
