#!/usr/bin/env bash
# Build the harness image (default tag evalplane/harness:dev) from the debootstrap base image.
# Containers here cannot reach PyPI (TLS interception), so wheels are fetched on the host, pinned by
# requirements.lock, into the build context (for the image's python 3.11.2: environment markers differ); the Dockerfile installs them with --no-index.
#   images/harness/build.sh [tag]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"; root="$(cd "$here/../.." && pwd)"
tag="${1:-${EVALPLANE_HARNESS_IMAGE:-evalplane/harness:dev}}"
py="${PYTHON:-$root/.venv/bin/python}"
"$root/scripts/docker.sh" up
ctx="$(mktemp -d)"; trap 'rm -rf "$ctx"' EXIT
cache="${EVALPLANE_WHEEL_CACHE:-$root/.state/wheels/harness}"
mkdir -p "$cache" "$ctx/src"
grep -E '^[A-Za-z0-9_.-]+(\[[^]]*\])?==' "$root/requirements.lock" > "$ctx/constraints.txt"
cp "$here/Dockerfile" "$here/requirements.txt" "$ctx/"
"$py" -m pip download -q --only-binary=:all: --python-version 3.11.2 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform linux_x86_64 --platform any \
  -c "$ctx/constraints.txt" -r "$here/requirements.txt" pip -d "$cache"
cp -r "$cache" "$ctx/wheels"
for pkg in contract harness shim; do
  (cd "$root" && find "$pkg" -name '__pycache__' -prune -o -type f \( -name '*.py' -o -name '*.sql' -o -name '*.yaml' -o -name '*.json' \) -print) \
    | (cd "$root" && xargs -I{} cp --parents {} "$ctx/src/")
done
docker build -q -t "$tag" "$ctx" >/dev/null
echo "$tag"
