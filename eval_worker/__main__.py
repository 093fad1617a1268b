"""python -m eval_worker --queue URL [--logs-root DIR] [--once] [--idle-exit SECONDS] [--visibility-timeout S]"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval_worker", description="Grade EvalJob messages from SQS.")
    ap.add_argument("--queue", required=True, help="eval queue URL (SQS)")
    ap.add_argument("--logs-root", type=Path, default=Path("."),
                    help="root of the official layout logs/run_evaluation/... (default: current directory)")
    ap.add_argument(
        "--once", action="store_true", help="handle at most one message (one long poll), then exit"
    )
    ap.add_argument("--idle-exit", type=float, default=None, metavar="SECONDS",
                    help="exit after this many seconds without a message")
    ap.add_argument("--visibility-timeout", type=int, default=120, metavar="S",
                    help="visibility timeout per message; extended every S/3 while grading (default 120)")
    ap.add_argument("--wait-time", type=int, default=20, help="long-polling wait per receive (max 20)")
    ap.add_argument(
        "--sandbox-root", type=Path, default=None, help="where sandboxes are created (default: TMPDIR)"
    )
    ap.add_argument("--keep-sandboxes", action="store_true", help="do not delete sandboxes (debugging)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("botocore").setLevel(logging.WARNING)

    from eval_worker.sandbox import ProcessBackend
    from eval_worker.worker import EvalWorker

    worker = EvalWorker(
        args.queue,
        logs_root=args.logs_root,
        backend=ProcessBackend(root=args.sandbox_root, keep=args.keep_sandboxes),
        visibility_timeout=args.visibility_timeout,
        wait_time_s=min(max(args.wait_time, 0), 20),
    )
    try:
        n = worker.run(once=args.once, idle_exit=args.idle_exit)
    except KeyboardInterrupt:
        return 130
    logging.getLogger("eval_worker").info("handled %d message(s)", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
