#!/usr/bin/env bash
# The local stack: PostgreSQL where DATABASE_URL (or the default on 127.0.0.1) answers, otherwise installed with apt
# and started under .state/; and the project's own Valkey-compatible server (unless VALKEY_URL names one): its own
# port, its files under .state/valkey, no default user, an admin user whose password is generated into a 0600 file
# (.state/valkey/admin.url, the default VALKEY_URL). The machine's own Redis, if any, is never touched.
# S3 and SQS come from moto's server mode, which the dispatcher starts on loopback when it needs it; so is the gateway
# tier (gateway/tier.py: LiteLLM replicas behind haproxy, which `up` installs here).
#   scripts/stack.sh up      start what is missing, print the environment to use
#   scripts/stack.sh down    stop what this script started
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${EVALPLANE_STATE_DIR:-$PWD/.state}"
mkdir -p "$STATE"
DATABASE_URL="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/test}"
VALKEY_DIR="$STATE/valkey"
ADMIN_URL_FILE="$VALKEY_DIR/admin.url"  # contract.valkey_auth.default_url reads the same file
case "${VALKEY_URL:-}" in
  *:*@*) ;;  # a server with credentials, named by the caller: used as it is
  "") ;;
  *) echo "stack: VALKEY_URL=$VALKEY_URL has no credentials (tasks could write any key): using the project's own" >&2
     VALKEY_URL="" ;;
esac
if [ -z "${VALKEY_URL:-}" ] && [ -f "$ADMIN_URL_FILE" ]; then VALKEY_URL=$(cat "$ADMIN_URL_FILE"); fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

. scripts/lib/apt.sh

pg_up() { .venv/bin/python - "$DATABASE_URL" <<'PY' 2>/dev/null
import sys, psycopg
psycopg.connect(sys.argv[1], connect_timeout=2).close()
PY
}
valkey_up() { [ -n "${VALKEY_URL:-}" ] && .venv/bin/python - "$VALKEY_URL" <<'PY' 2>/dev/null
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
  # Our own server: a free port, a config file (0600: it holds the admin password, never a command line) with the
  # default user off, so nothing connects without a user and its password.
  local server; server=$(command -v valkey-server || command -v redis-server || true)
  if [ -z "$server" ]; then apt_install valkey-server 2>/dev/null || apt_install redis-server
    server=$(command -v valkey-server || command -v redis-server); fi
  mkdir -p "$VALKEY_DIR"; chmod 700 "$VALKEY_DIR"
  local port password
  port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  password=$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(24))')
  ( umask 077
    cat > "$VALKEY_DIR/valkey.conf" <<CONF
bind 127.0.0.1
port $port
protected-mode yes
daemonize yes
save ""
appendonly no
dir $VALKEY_DIR
logfile $VALKEY_DIR/server.log
pidfile $VALKEY_DIR/server.pid
user default off
user admin on >$password ~* &* +@all
CONF
    echo "redis://admin:$password@127.0.0.1:$port/0" > "$ADMIN_URL_FILE" )
  "$server" "$VALKEY_DIR/valkey.conf"
  VALKEY_URL=$(cat "$ADMIN_URL_FILE")
  for _ in $(seq 50); do valkey_up && break; sleep 0.1; done
}

case "${1:-up}" in
  up)
    pg_up || { echo "stack: PostgreSQL does not answer at $DATABASE_URL; starting one under $STATE/pg" >&2; start_postgres; }
    pg_up || { echo "stack: PostgreSQL still does not answer at $DATABASE_URL" >&2; exit 1; }
    valkey_up || { echo "stack: starting the project's Valkey under $VALKEY_DIR" >&2; start_valkey; }
    valkey_up || { echo "stack: Valkey does not answer (see $VALKEY_DIR/server.log)" >&2; exit 1; }
    command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || apt_install haproxy  # the gateway tier's balancer
    echo "DATABASE_URL=$DATABASE_URL"
    echo "VALKEY_URL=$VALKEY_URL"
    ;;
  down)
    if [ -f "$STATE/pg.started" ]; then
      bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
      run_as=(); [ "$(id -u)" -eq 0 ] && run_as=(runuser -u postgres --)
      "${run_as[@]}" "$bin/pg_ctl" -D "$(cat "$STATE/pg.started")" stop >/dev/null || true; rm -f "$STATE/pg.started"
    fi
    [ -f "$VALKEY_DIR/server.pid" ] && kill "$(cat "$VALKEY_DIR/server.pid")" 2>/dev/null || true
    rm -f "$ADMIN_URL_FILE"
    .venv/bin/python -c 'from dispatcher.backends import daemons; daemons.stop("moto"); daemons.stop("package-index"); daemons.stop_gateway()' || true
    ;;
  *) echo "usage: scripts/stack.sh up|down" >&2; exit 2 ;;
esac
