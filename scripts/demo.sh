#!/usr/bin/env bash
# One command for a new user: install, start the local stack, run the demo evaluation, print the results.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
eval "$(scripts/stack.sh up | sed 's/^/export /')"
exec .venv/bin/python -m dispatcher run "${1:-examples/local.toml}"
