#!/usr/bin/env bash
# One command for the test suite: install, start the local stack, run pytest. .ci/run calls this.
#   scripts/test.sh [pytest args]         every tier (tests/tiers.py): PostgreSQL, Valkey and Docker are started first
#   scripts/test.sh --fast [pytest args]  the unit tier only, with no service started, in a network namespace of its
#                                         own: nothing of the host answers there, which proves the tier needs none
# Other arguments go to pytest (e.g. scripts/test.sh -q -m services).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = --fast ]; then
  fast=1
  shift
fi
scripts/bootstrap.sh

if [ "$fast" = 1 ]; then
  # Bytecode caches, kept under .state/ rather than beside the sources: without them (PYTHONDONTWRITEBYTECODE) each
  # run compiles some 6,000 modules again, a third of the tier's time.
  export PYTHONPYCACHEPREFIX="$PWD/.state/pycache"
  unset PYTHONDONTWRITEBYTECODE
  # A new network namespace has only its own loopback (brought up for the servers tests start themselves); root
  # makes one directly, anyone else inside a user namespace of their own.
  if [ "$(id -u)" = 0 ]; then ns=(unshare --net); else ns=(unshare --net --map-root-user); fi
  if ! command -v ip >/dev/null || ! "${ns[@]}" true 2>/dev/null; then
    msg="test: cannot make a network namespace (${ns[*]}; ip from iproute2)"
    if [ "${CI:-}" = true ]; then
      echo "$msg: under CI=true the unit tier must run isolated" >&2
      exit 1
    fi
    echo "$msg; running the unit tier without isolation" >&2
    exec .venv/bin/python -m pytest -m unit --durations=10 "$@"
  fi
  # Docker's socket is a file, which a network namespace does not hide: point its clients at none.
  exec "${ns[@]}" -- sh -c 'ip link set lo up && exec "$@"' sh \
    env DOCKER_HOST=unix:///nonexistent/docker.sock .venv/bin/python -m pytest -m unit --durations=10 "$@"
fi

eval "$(scripts/stack.sh up | sed 's/^/export /')"
# Docker-backed tests (grading in official images, the docker launcher) need an engine and the base
# image. Where none can be started they fail under CI=true, and are skipped with a reason otherwise.
scripts/docker.sh up || echo "test: no Docker engine could be started; Docker tests will fail under CI=true" >&2
exec .venv/bin/python -m pytest --durations=15 "$@"
