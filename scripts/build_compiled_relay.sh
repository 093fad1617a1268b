#!/usr/bin/env bash
# Build bench/compiled_relay (the bench's relays compiled, a yardstick: docs/shim.md, Bench) offline, from Debian's
# packaged crates; installs cargo and the crates with apt if missing. Prints the binary's path.
#   scripts/build_compiled_relay.sh [--test]   (--test: run its unit tests first)
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${EVALPLANE_STATE_DIR:-$PWD/.state}"
need_apt=()
command -v cargo >/dev/null || need_apt+=(cargo)
ls -d /usr/share/cargo/registry/serde_json-1.* >/dev/null 2>&1 || need_apt+=(librust-serde-json-dev)
ls -d /usr/share/cargo/registry/memchr-2.* >/dev/null 2>&1 || need_apt+=(librust-memchr-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "build_compiled_relay: installing ${need_apt[*]} with apt" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >&2
fi
mkdir -p "$STATE/cargo"
cat >"$STATE/cargo/config.toml" <<'TOML'
[source.crates-io]
replace-with = "debian"
[source.debian]
directory = "/usr/share/cargo/registry"
[net]
offline = true
TOML
# built from a copy: its Cargo.lock (resolved against Debian's crates, in the format of whichever cargo ran) stays out
# of the source tree
src="$STATE/compiled_relay-src"
rm -rf "$src" && mkdir -p "$src" && cp -rp bench/compiled_relay/Cargo.toml bench/compiled_relay/src "$src/"
export CARGO_HOME="$STATE/cargo" CARGO_TARGET_DIR="$STATE/compiled_relay-target"
if [ "${1:-}" = "--test" ]; then
  (cd "$src" && cargo test --release -q >&2)
fi
(cd "$src" && cargo build --release -q >&2)
cp "$STATE/compiled_relay-target/release/compiled_relay" "$STATE/compiled_relay"
echo "$STATE/compiled_relay"
