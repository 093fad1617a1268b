#!/bin/bash
# Make the conda env `testbed` of the official layout: a venv from PYTHON at ROOT/envs/testbed holding the
# given requirements, installed from the wheelhouse WHEELS only, with a pip config inside the venv that keeps
# its pip (and so the eval script's own `pip install -e .`) offline on that wheelhouse: the stand-in for the
# official images' network. Used by the instance images (Dockerfile) and the process grading backend
# (eval_worker.environments), so both build the same environment from the same recipe.
#   testbed-env.sh ROOT PYTHON WHEELS [REQUIREMENT...]
set -euo pipefail
root=$1 python=$2 wheels=$3
shift 3
"$python" -m venv "$root/envs/testbed"
printf '[global]\nno-index = true\nfind-links = %s\ndisable-pip-version-check = true\n' "$wheels" \
  > "$root/envs/testbed/pip.conf"
if [ $# -gt 0 ]; then
  "$root/envs/testbed/bin/python" -m pip install -q --no-index --find-links "$wheels" "$@"
fi
