#!/usr/bin/env bash
# One command for the test suite: install, start the local stack, run pytest. .ci/run calls this.
#   scripts/test.sh [pytest args]         every tier (tests/tiers.py): PostgreSQL, Valkey and Docker are started first
#   scripts/test.sh --fast [pytest args]  the unit tier only, with no service started, in a network namespace of its
#                                         own: nothing of the host answers there, which proves the tier needs none;
#                                         one pytest worker per core (pytest-xdist), as nothing in it is shared
#   scripts/test.sh --workers N [pytest args]
#                                         every tier but unit (CI): the services, docker and e2e tiers in one session
#                                         of N pytest-xdist workers, then the tests marked `alone`, with nothing beside
#   scripts/test.sh --side-by-side [pytest args]
#                                         every tier but unit: the services tier (with the e2e runs that need no
#                                         Docker, marked no_docker) in a session of its own beside the docker and
#                                         e2e tiers, then the tests marked `alone`
# Other arguments go to pytest (e.g. scripts/test.sh -q -m services).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in
  --fast) mode=fast; shift ;;
  --side-by-side) mode=side; shift ;;
  --workers) mode=workers; workers=${2:?--workers takes a number}; shift 2 ;;
esac
scripts/bootstrap.sh

if [ "$mode" = fast ]; then
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
    exec .venv/bin/python -m pytest -m unit -n auto --durations=10 "$@"
  fi
  # Docker's socket is a file, which a network namespace does not hide: point its clients at none.
  exec "${ns[@]}" -- sh -c 'ip link set lo up && exec "$@"' sh \
    env DOCKER_HOST=unix:///nonexistent/docker.sock .venv/bin/python -m pytest -m unit -n auto --durations=10 "$@"
fi

eval "$(scripts/stack.sh up | sed 's/^/export /')"
# Docker-backed tests (grading in official images, the docker launcher) need an engine and the base
# image. Where none can be started they fail under CI=true, and are skipped with a reason otherwise.
docker=1
scripts/docker.sh up || { docker=0; echo "test: no Docker engine could be started; Docker tests will fail under CI=true" >&2; }
# The images the Docker tiers share, built before their tests (seconds where they exist; most of the tiers' time on a
# new machine, which no single test's timeout should carry). A failure here shows again in the tests that need them.
prebuild() {
  [ "$docker" = 1 ] || return 0
  local t0=$SECONDS
  .venv/bin/python -m tests.prebuild || echo "test: building the shared images failed (above)" >&2
  echo "test: shared images ready in $((SECONDS - t0)) s" >&2
}
if [ "$mode" = all ]; then
  prebuild
  exec .venv/bin/python -m pytest --durations=15 "$@"
fi
mkdir -p .state/junit  # every test's time, per session
alone() {
  .venv/bin/python -m pytest --durations=5 -m "alone and not unit" --junitxml=.state/junit/alone.xml "$@"
}
if [ "$mode" = workers ]; then
  # The services tier waits on round trips, the docker and e2e tiers on containers and runs, so N workers share the
  # cores. Each worker has its own database, moto, task network and loopback port to Valkey (tests/conftest.py); a
  # group's tests (a file, a folder sharing runs, a harness) stay on one worker, heaviest first (tests/tiers.py).
  rc=0
  prebuild
  .venv/bin/python -m pytest -n "$workers" --dist loadgroup --durations=25 -m "not unit and not alone" \
    --junitxml=.state/junit/workers.xml "$@" || rc=1
  alone "$@" || rc=1
  exit "$rc"
fi
# The services tier in a session of its own beside the docker and e2e tiers (one waits on round trips to PostgreSQL
# and Valkey, the other on containers and runs); the e2e runs that need no Docker (no_docker, tests/tiers.py) go with
# the services tier, to even the two out. Each session has its own database (tests/conftest.py), and the
# services session's output is printed when it ends. Then the tests marked `alone`, with nothing beside.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
.venv/bin/python -m pytest --durations=15 -m "(services or no_docker) and not alone" \
  --junitxml=.state/junit/services.xml "$@" >"$log" 2>&1 &
services=$!
rc=0
prebuild
.venv/bin/python -m pytest --durations=15 -m "(docker or e2e) and not no_docker and not alone" \
  --junitxml=.state/junit/docker-e2e.xml "$@" || rc=1
wait "$services" || rc=1
echo "::: the services tier, beside the docker and e2e tiers" >&2
cat "$log"
alone "$@" || rc=1
exit "$rc"
