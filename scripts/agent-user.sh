#!/usr/bin/env bash
# The agent's system user (harness/sandbox.py AGENT_USER): the process launcher runs every harness as it, apart
# from the task runner and the shim. Idempotent; needs root. Task images add theirs at task start instead.
set -euo pipefail
NAME=evalplane-agent
getent passwd "$NAME" >/dev/null && exit 0
[ "$(id -u)" -eq 0 ] || { echo "agent-user.sh: creating the system user $NAME needs root" >&2; exit 1; }
useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$NAME"
