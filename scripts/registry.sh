#!/usr/bin/env bash
# A private image registry on loopback for the local backend: Debian's docker-registry (the distribution project's
# registry), its storage under .state/registry/<port>. Task images are pushed there and run by digest
# (spec: [images] registry = "127.0.0.1:PORT"; a loopback registry needs no TLS).
#   scripts/registry.sh up [PORT]     start it where nothing answers on PORT (default 5000); prints 127.0.0.1:PORT
#   scripts/registry.sh down [PORT]   stop the one this script started on PORT
#   scripts/registry.sh du [PORT]     the bytes its storage holds (what pushes added, from the registry's own files)
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${EVALPLANE_STATE_DIR:-$PWD/.state}"
PORT="${2:-5000}"
dir="$STATE/registry/$PORT"
. scripts/lib/apt.sh

answers() { python3 - "$PORT" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/", timeout=2)
PY
}

case "${1:-up}" in
  up)
    if ! answers; then
      command -v docker-registry >/dev/null || apt_install docker-registry
      mkdir -p "$dir/data"
      printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:%s\n' \
        "$dir/data" "$PORT" > "$dir/config.yml"
      nohup docker-registry serve "$dir/config.yml" >"$dir/registry.log" 2>&1 &
      echo $! > "$dir/pid"
      for _ in $(seq 100); do answers && break; sleep 0.1; done
      answers || { echo "registry: nothing answers on 127.0.0.1:$PORT; see $dir/registry.log" >&2; exit 1; }
    fi
    echo "127.0.0.1:$PORT"
    ;;
  down)
    [ -f "$dir/pid" ] && kill "$(cat "$dir/pid")" 2>/dev/null || true
    rm -f "$dir/pid"
    ;;
  du)
    [ -d "$dir/data" ] || { echo "registry: no storage at $dir/data" >&2; exit 1; }
    find "$dir/data" -type f -printf '%s\n' | awk '{n += $1} END {print n + 0}'
    ;;
  *) echo "usage: scripts/registry.sh up|down|du [PORT]" >&2; exit 2 ;;
esac
