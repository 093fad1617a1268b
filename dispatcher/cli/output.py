"""The two consoles every command writes to: results on stdout, problems and progress on stderr."""

from __future__ import annotations

import sys

from rich.console import Console


def _console(stderr: bool) -> Console:
    # The results table (tokens, compute and their costs) wants ~190 columns: use them when the stream is not a
    # terminal (logs, CI, pipes).
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    return Console(stderr=stderr) if tty else Console(stderr=stderr, width=200)


out = _console(stderr=False)
err = _console(stderr=True)


def plain(console: Console, text: str) -> None:
    """A line that is data (an instance id, a spec problem, a path), never rich markup."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def print_problems(what: str, problems: dict[str, str]) -> None:
    err.print(f"[bold red]{len(problems)} instance(s) without {what}:[/]")
    for iid, why in sorted(problems.items()):
        plain(err, f"  {iid}: {why}")
