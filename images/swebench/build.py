#!/usr/bin/env python3
"""Build SWE-bench-shaped eval images for a dataset's instances (see eval_worker/images.py).

  python images/swebench/build.py [--dataset examples/synthetic/instances.jsonl] [--instances ID ...]
         [--base evalplane/debian:bookworm] [--force]
  python images/swebench/build.py --instances ID --broken no-pytest --tag NAME   # a broken image
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval_worker.images import main

if __name__ == "__main__":
    sys.exit(main())
