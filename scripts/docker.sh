#!/usr/bin/env bash
# A Docker engine and the project's base images, on a machine that has neither and reaches no public
# image registry: install docker.io with apt, start dockerd, and build evalplane/debian:<release> from
# Debian's own packages with debootstrap + `docker import`, from the mirror this machine's apt uses.
#   scripts/docker.sh engine              ensure an engine answers (install and start it if not)
#   scripts/docker.sh base [RELEASE]      ensure evalplane/debian:RELEASE exists (default bookworm; ~2 min once)
#   scripts/docker.sh up                  engine, then the bookworm base
# bullseye (glibc 2.31, older than the official instance images' Ubuntu 22.04) is the base of the SWE-bench-shaped
# instance images and of the task runtime's build, so what runs there runs on the official images too.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${EVALPLANE_STATE_DIR:-$PWD/.state}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
mkdir -p "$STATE"

. scripts/lib/apt.sh
. scripts/lib/debian_mirror.sh

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
  local release="${1:-bookworm}"
  local image="evalplane/debian:$release"
  if docker image inspect "$image" >/dev/null 2>&1; then return 0; fi
  command -v debootstrap >/dev/null || apt_install debootstrap
  local mirror; mirror=$(debian_mirror)
  local root; root=$(mktemp -d "$STATE/rootfs.XXXX")
  echo "docker: building $image with debootstrap" >&2
  $SUDO debootstrap --variant=minbase --include=ca-certificates,git,python3,python3-venv,patch \
    "$release" "$root" "$mirror" >"$STATE/debootstrap-$release.log" 2>&1
  $SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  $SUDO tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$image" >/dev/null
  $SUDO rm -rf "$root"
}

case "${1:-up}" in
  engine) engine ;;
  base) engine && base "${2:-bookworm}" ;;
  up) engine && base bookworm ;;
  *) echo "usage: scripts/docker.sh engine|base [RELEASE]|up" >&2; exit 2 ;;
esac
