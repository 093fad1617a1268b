#!/usr/bin/env bash
# One command for the whole test suite: install, start the local stack, run pytest. .ci/run calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
eval "$(scripts/stack.sh up | sed 's/^/export /')"
exec .venv/bin/python -m pytest "$@"
