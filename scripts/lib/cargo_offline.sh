# Sourced by the scripts that build Rust crates (build_dataplane.sh, build_compiled_relay.sh): cargo offline against
# Debian's packaged crates (installed with apt if missing), and `cargo_build CRATE_DIR BIN [--test] [EXTRA_SRC...]`
# which builds from a copy in $STATE (its Cargo.lock, resolved against Debian's crates in the format of whichever
# cargo ran, stays out of the source tree) and copies the binary to $STATE/BIN.
STATE="${EVALPLANE_STATE_DIR:-$PWD/.state}"
_need_apt=()
command -v cargo >/dev/null || _need_apt+=(cargo)
ls -d /usr/share/cargo/registry/serde_json-1.* >/dev/null 2>&1 || _need_apt+=(librust-serde-json-dev)
ls -d /usr/share/cargo/registry/serde-1.* >/dev/null 2>&1 || _need_apt+=(librust-serde-dev)
ls -d /usr/share/cargo/registry/memchr-2.* >/dev/null 2>&1 || _need_apt+=(librust-memchr-dev)
ls -d /usr/share/cargo/registry/libc-0.2.* >/dev/null 2>&1 || _need_apt+=(librust-libc-dev)
if [ ${#_need_apt[@]} -gt 0 ]; then
  echo "cargo_offline: installing ${_need_apt[*]} with apt" >&2
  . "$(dirname "${BASH_SOURCE[0]}")/apt.sh"
  apt_install "${_need_apt[@]}"
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
export CARGO_HOME="$STATE/cargo"

cargo_build() {
  local crate="$1" bin="$2" test="${3:-}"
  shift 3 || shift $#
  local src="$STATE/$bin-src"
  rm -rf "$src" && mkdir -p "$src" && cp -rp "$crate/Cargo.toml" "$crate/src" "$src/"
  local extra
  for extra in "$@"; do cp -p "$extra" "$src/src/"; done
  export CARGO_TARGET_DIR="$STATE/$bin-target"
  if [ "$test" = "--test" ]; then
    (cd "$src" && cargo test --release -q >&2)
  fi
  (cd "$src" && cargo build --release -q >&2)
  cp "$CARGO_TARGET_DIR/release/$bin" "$STATE/$bin.new" && mv "$STATE/$bin.new" "$STATE/$bin"
  echo "$STATE/$bin"
}
