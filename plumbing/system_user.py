"""The project's system users on a host: who runs untrusted code apart from the processes that hold secrets.

`evalplane-agent` runs the harness on the process launcher (harness/sandbox.py); `evalplane-grader` runs the eval
script on the process grading backend (eval_worker/sandbox.py). Both are made by scripts/system-user.sh (root).
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "system-user.sh"


class SystemUserError(RuntimeError):
    """The user is missing and could not be made here (not root)."""


def ensure(name: str) -> pwd.struct_passwd:
    """The system user `name`, created with scripts/system-user.sh if missing (root only)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        p = subprocess.run([str(SCRIPT), name], capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
        if p.returncode != 0:
            raise SystemUserError(f"no user {name} on this host and {SCRIPT} {name} failed: {p.stderr.strip()}") from None
        return pwd.getpwnam(name)


def give(path: Path, uid: int, gid: int) -> None:
    """path and everything under it owned by uid:gid (links themselves, never what they point to)."""
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
