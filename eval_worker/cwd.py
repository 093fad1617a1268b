"""One process-wide lock around chdir: swebench writes logs/run_evaluation/... relative to the CWD.

The official run_instance and make_run_report take no output directory, so we run them from the logs
root. The CWD belongs to the whole process, hence one lock: gradings that need it are serialised per
process (run more worker processes for concurrency; the process backend never needs the CWD).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_LOCK = threading.RLock()


@contextlib.contextmanager
def in_directory(path: str | Path) -> Iterator[Path]:
    p = Path(path).resolve()
    with _LOCK:
        old = os.getcwd()
        os.chdir(p)
        try:
            yield p
        finally:
            os.chdir(old)
