#!/usr/bin/env bash
# Build bench/compiled_relay (the bench's relays compiled, a yardstick: docs/shim.md, Bench) offline, from Debian's
# packaged crates; installs cargo and the crates with apt if missing. Prints the binary's path.
#   scripts/build_compiled_relay.sh [--test]   (--test: run its unit tests first)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/cargo_offline.sh
# its JSON scanner is the shim's data plane's (shim/dataplane/src/scan.rs)
cargo_build bench/compiled_relay compiled_relay "${1:-}" shim/dataplane/src/scan.rs
