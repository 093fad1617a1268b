#!/usr/bin/env bash
# Install what the project needs on a fresh Debian/Ubuntu machine: system packages, then the virtualenv
# from requirements.lock (one resolve of requirements.in; `uv pip compile requirements.in -o requirements.lock`).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v git >/dev/null || need_apt+=(git)
command -v python3 >/dev/null || need_apt+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
command -v bwrap >/dev/null || need_apt+=(bubblewrap)  # the process grading backend confines the eval script with it
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing ${need_apt[*]} with apt" >&2
  . scripts/lib/apt.sh
  apt_install "${need_apt[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if [ ! -x .venv/bin/uv ]; then
  .venv/bin/python -m pip install -q uv
fi
.venv/bin/uv pip sync -q --python .venv/bin/python requirements.lock
.venv/bin/uv pip install -q --python .venv/bin/python --no-deps -e .
.venv/bin/python -m pip check >/dev/null || { .venv/bin/python -m pip check; exit 1; }
