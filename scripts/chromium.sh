#!/usr/bin/env bash
# Headless Chromium for the browser tests: Debian's chromium and chromium-driver (no browser download from
# anywhere else works on these machines). Prints the two paths, browser first, once both are there.
#   scripts/chromium.sh        install what is missing (apt), print /usr/bin/chromium and /usr/bin/chromedriver
set -euo pipefail
cd "$(dirname "$0")/.."

browser=$(command -v chromium || true)
driver=$(command -v chromedriver || true)
if [ -z "$browser" ] || [ -z "$driver" ]; then
  echo "chromium: installing Debian's chromium and chromium-driver with apt" >&2
  . scripts/lib/apt.sh
  apt_install --no-install-recommends chromium chromium-driver fonts-liberation
  browser=$(command -v chromium)
  driver=$(command -v chromedriver)
fi
"$browser" --version >&2
echo "$browser"
echo "$driver"
