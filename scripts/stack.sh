#!/usr/bin/env bash
# The local stack: PostgreSQL and a Valkey-compatible server where DATABASE_URL / VALKEY_URL (or the
# defaults on 127.0.0.1) answer; otherwise install them with apt and start them under .state/.
# S3 and SQS come from moto's server mode, which the dispatcher starts on loopback when it needs it.
#   scripts/stack.sh up      start what is missing, print the environment to use
#   scripts/stack.sh down    stop what this script started
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${EVALPLANE_STATE_DIR:-$PWD/.state}"
mkdir -p "$STATE"
DATABASE_URL="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/test}"
VALKEY_URL="${VALKEY_URL:-redis://127.0.0.1:6379/0}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

. scripts/lib/apt.sh

pg_up() { .venv/bin/python - "$DATABASE_URL" <<'PY' 2>/dev/null
import sys, psycopg
psycopg.connect(sys.argv[1], connect_timeout=2).close()
PY
}
valkey_up() { .venv/bin/python - "$VALKEY_URL" <<'PY' 2>/dev/null
import sys, redis
redis.Redis.from_url(sys.argv[1], socket_connect_timeout=2).ping()
PY
}

start_postgres() {
  # A cluster of our own under .state/pg on the default URL's port, trust auth, database "test".
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then apt_install postgresql; fi
  local bin; bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  local data="$STATE/pg"; local run_as=(); [ "$(id -u)" -eq 0 ] && run_as=(runuser -u postgres --)
  if [ ! -f "$data/PG_VERSION" ]; then
    mkdir -p "$data"; [ "$(id -u)" -eq 0 ] && chown postgres "$data" "$STATE"
    "${run_as[@]}" "$bin/initdb" -D "$data" -U postgres --auth=trust >/dev/null
  fi
  "${run_as[@]}" "$bin/pg_ctl" -D "$data" -l "$data/server.log" -o "-p 5432 -k /tmp -c listen_addresses=127.0.0.1" -w start >/dev/null
  "${run_as[@]}" "$bin/psql" -h 127.0.0.1 -U postgres -tc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
    || "${run_as[@]}" "$bin/createdb" -h 127.0.0.1 -U postgres test
  echo "$data" > "$STATE/pg.started"
}

start_valkey() {
  local server; server=$(command -v valkey-server || command -v redis-server || true)
  if [ -z "$server" ]; then apt_install valkey-server 2>/dev/null || apt_install redis-server
    server=$(command -v valkey-server || command -v redis-server); fi
  mkdir -p "$STATE/valkey"
  "$server" --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir "$STATE/valkey" --logfile "$STATE/valkey/server.log" --pidfile "$STATE/valkey/server.pid"
  for _ in $(seq 50); do valkey_up && break; sleep 0.1; done
}

case "${1:-up}" in
  up)
    pg_up || { echo "stack: PostgreSQL does not answer at $DATABASE_URL; starting one under $STATE/pg" >&2; start_postgres; }
    pg_up || { echo "stack: PostgreSQL still does not answer at $DATABASE_URL" >&2; exit 1; }
    valkey_up || { echo "stack: Valkey does not answer at $VALKEY_URL; starting one under $STATE/valkey" >&2; start_valkey; }
    valkey_up || { echo "stack: Valkey still does not answer at $VALKEY_URL" >&2; exit 1; }
    echo "DATABASE_URL=$DATABASE_URL"
    echo "VALKEY_URL=$VALKEY_URL"
    ;;
  down)
    if [ -f "$STATE/pg.started" ]; then
      bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
      run_as=(); [ "$(id -u)" -eq 0 ] && run_as=(runuser -u postgres --)
      "${run_as[@]}" "$bin/pg_ctl" -D "$(cat "$STATE/pg.started")" stop >/dev/null || true; rm -f "$STATE/pg.started"
    fi
    [ -f "$STATE/valkey/server.pid" ] && kill "$(cat "$STATE/valkey/server.pid")" 2>/dev/null || true
    .venv/bin/python -c 'from dispatcher import localstack; localstack.stop_moto()' || true
    ;;
  *) echo "usage: scripts/stack.sh up|down" >&2; exit 2 ;;
esac
