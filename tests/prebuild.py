"""Build the images the Docker tiers share before their tests start: the synthetic instances' SWE-bench-shaped images
and the task runtime (its own CPython, compiled from Debian's source package, and mini-swe-agent's layer).

    python -m tests.prebuild

On a machine that has them this takes seconds (each is reused while its inputs are unchanged); on a new one, most of
the Docker tiers' time. Built here, that time is not charged to whichever test happens to need an image first (its
timeout is sized for the test, not for compiling Python), and scripts/test.sh prints what it took."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ROOT / "examples" / "synthetic"


def main() -> int:
    import docker

    from dispatcher.images import build_runtime
    from eval_worker.images import DEFAULT_BASE, build_images, ensure_base, load_rows

    client = docker.from_env(timeout=900)
    t0 = time.monotonic()
    ensure_base(client, DEFAULT_BASE)
    built = build_images(load_rows(SYNTHETIC / "instances.jsonl"), repos_dir=SYNTHETIC / "repos", client=client)
    t1 = time.monotonic()
    print(f"prebuild: {len(built)} instance image(s) in {t1 - t0:.0f} s", flush=True)
    runtime = build_runtime(client, "mini-swe-agent")
    print(f"prebuild: the task runtime with mini-swe-agent ({runtime.tag}) in {time.monotonic() - t1:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
