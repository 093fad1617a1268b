"""The command line: `evalplane COMMAND ...` (also `python -m dispatcher COMMAND ...`). The commands live by what
they concern (preflight: before a run; runs: a run's life; results: after it); `main` is the one boundary where a
failure a user can act on (a spec's problems, a stack part down, a refusal) becomes lines on stderr and an exit code."""

from __future__ import annotations

import logging
import sys

import typer

from dispatcher.cli import preflight, results, runs
from dispatcher.cli.errors import EXIT_CONFLICT, EXIT_SPEC, EXIT_STACK_DOWN, explain
from dispatcher.cli.output import err

__all__ = ["EXIT_CONFLICT", "EXIT_SPEC", "EXIT_STACK_DOWN", "app", "main"]

app = typer.Typer(help="evalplane: evaluate coding agents on SWE-bench, from a spec file (a TOML run description).",
                  add_completion=False, no_args_is_help=True, rich_markup_mode="markdown", pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
app.command()(preflight.validate)
app.command()(preflight.forecast)
app.command("plan", hidden=True)(preflight.forecast)  # its old name, kept for scripts
app.command()(preflight.images)
app.command()(runs.run)
app.command()(runs.resume)
app.command()(runs.pause)
app.command()(runs.resize)
app.command()(runs.cancel)
app.command()(runs.retry)
app.command()(runs.status)
app.command()(runs.dashboard)
app.command()(results.report)
app.command()(results.regrade)
app.command()(results.judge)


def main(argv: list[str] | None = None, prog_name: str = "evalplane") -> int:
    """Run one command; returns its exit code (0 when it returns, typer.Exit's code otherwise)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        app(args=sys.argv[1:] if argv is None else argv, prog_name=prog_name)
    except SystemExit as e:  # the app always ends this way: a command's return, typer.Exit, a usage error
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        explained = explain(e)
        if explained is None:
            raise
        lines, code = explained
        for line in lines:
            err.print(line, highlight=False, soft_wrap=True)
        return code
    return 0
