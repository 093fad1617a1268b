#!/usr/bin/env bash
# A Docker engine and the project's base image, on a machine that has neither and reaches no public
# image registry: install docker.io with apt, start dockerd, and build evalplane/debian:bookworm from
# Debian's own packages with debootstrap + `docker import`.
#   scripts/docker.sh engine    ensure an engine answers (install and start it if not)
#   scripts/docker.sh base      ensure the base image exists (builds it once, ~2 min)
#   scripts/docker.sh up        both
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${EVALPLANE_STATE_DIR:-$PWD/.state}"
BASE_IMAGE="${EVALPLANE_BASE_IMAGE:-evalplane/debian:bookworm}"
MIRROR="${EVALPLANE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
mkdir -p "$STATE"

. scripts/lib/apt.sh

engine() {
  if docker info >/dev/null 2>&1; then return 0; fi
  command -v dockerd >/dev/null || apt_install docker.io
  if ! pgrep -x dockerd >/dev/null; then
    echo "docker: starting dockerd (log: $STATE/dockerd.log)" >&2
    $SUDO sh -c "nohup dockerd >'$STATE/dockerd.log' 2>&1 &"
  fi
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "docker: the engine did not come up; see $STATE/dockerd.log" >&2
  return 1
}

base() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return 0; fi
  command -v debootstrap >/dev/null || apt_install debootstrap
  local root; root=$(mktemp -d "$STATE/rootfs.XXXX")
  echo "docker: building $BASE_IMAGE with debootstrap from $MIRROR" >&2
  $SUDO debootstrap --variant=minbase --include=ca-certificates,git,python3,python3-venv,patch \
    bookworm "$root" "$MIRROR" >"$STATE/debootstrap.log" 2>&1
  $SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  $SUDO tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  $SUDO rm -rf "$root"
}

case "${1:-up}" in
  engine) engine ;;
  base) engine && base ;;
  up) engine && base ;;
  *) echo "usage: scripts/docker.sh engine|base|up" >&2; exit 2 ;;
esac
