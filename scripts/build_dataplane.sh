#!/usr/bin/env bash
# Build the shim's compiled data plane (shim/dataplane: docs/shim.md, "The data plane") offline, from Debian's
# packaged crates; installs cargo and the crates with apt if missing. Prints the binary's path ($STATE/shim_dataplane,
# where shim/front.py looks for it unless $SHIM_DATAPLANE_BIN says otherwise).
#   scripts/build_dataplane.sh [--test]   (--test: run its unit tests first)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/cargo_offline.sh
cargo_build shim/dataplane shim_dataplane "${1:-}"
