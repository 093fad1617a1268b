#!/usr/bin/env bash
# A system user of the project's (no home, no login shell, a group of its own): the process launcher runs every
# harness as evalplane-agent (harness/sandbox.py), the process grading backend every eval script as
# evalplane-grader (eval_worker/sandbox.py). Idempotent; needs root. Task images add the agent at task start instead.
#   scripts/system-user.sh NAME
set -euo pipefail
NAME=${1:?usage: scripts/system-user.sh NAME}
case "$NAME" in evalplane-agent|evalplane-grader) ;; *) echo "system-user.sh: not a user of the project's: $NAME" >&2; exit 2 ;; esac
getent passwd "$NAME" >/dev/null && exit 0
[ "$(id -u)" -eq 0 ] || { echo "system-user.sh: creating the system user $NAME needs root" >&2; exit 1; }
# Two callers at once (test sessions side by side): the second waits, then finds the user the first made
exec 9>/run/lock/evalplane-system-user.lock
flock 9
getent passwd "$NAME" >/dev/null && exit 0
useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$NAME"
