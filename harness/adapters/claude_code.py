"""Claude Code (npm @anthropic-ai/claude-code, its native binary), headless, against the shim's /v1/messages.

`claude -p --output-format stream-json --verbose`, the task on stdin; `--bare --tools Bash,Read,Edit` keeps its
requests small (no hooks, plugins, MCP servers or skills). It caps its own turns (`--max-turns`) and spend
(`--max-budget-usd`, by its own price table); the shim caps both anyway. `IS_SANDBOX=1` lets it skip permission
prompts as root; the DISABLE_* variables stop its telemetry, error reports, update checks and other calls home.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from contract.models import HarnessOutcome, Job
from harness.adapters.base import (
    Cap,
    HarnessRun,
    HarnessSettings,
    NpmHarness,
    harness_home,
    read_json_lines,
    write_task,
)

RESULTS = {
    "success": HarnessOutcome.SUBMITTED,
    "error_max_turns": HarnessOutcome.MAX_TURNS_EXCEEDED,
    "error_max_budget_usd": HarnessOutcome.BUDGET_EXCEEDED,
}


class ClaudeCodeSettings(HarnessSettings):
    bare: bool = Field(True, description="--bare: no hooks, plugins, MCP servers, skills or CLAUDE.md discovery")
    tools: str = Field("Bash,Read,Edit", min_length=1, description="--tools: the built-in tools it may use")


class ClaudeCode(NpmHarness):
    name = "claude-code"
    version = "2.1.328"
    npm_package = "@anthropic-ai/claude-code"
    binaries: ClassVar[dict[str, str]] = {"claude": "@anthropic-ai/claude-code-linux-x64/claude"}
    Settings = ClaudeCodeSettings
    caps = frozenset({Cap.TURNS, Cap.COST})
    providers = ("anthropic",)

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        home = harness_home(workdir)
        argv = [self.executable(), "-p", "--output-format", "stream-json", "--verbose", "--model", job.model.model,
                "--dangerously-skip-permissions", "--no-session-persistence"]
        if self.settings.bare:
            argv += ["--bare", "--tools", self.settings.tools]
        if job.limits.max_turns:
            argv += ["--max-turns", str(job.limits.max_turns)]
        if job.limits.cost_usd:
            argv += ["--max-budget-usd", f"{job.limits.cost_usd:.4f}"]
        env = env | {
            "HOME": str(home), "LANG": "C.UTF-8",
            "ANTHROPIC_BASE_URL": shim_url, "ANTHROPIC_API_KEY": local_token,
            "IS_SANDBOX": "1",  # it refuses --dangerously-skip-permissions as root otherwise
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_BUG_COMMAND": "1",
        }
        if self.settings.max_tokens:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.settings.max_tokens)
        return HarnessRun(argv=argv, env=env, trajectory=workdir / "trajectory.json",
                          stdin=write_task(job, self, testbed, workdir), stdout=workdir / "claude.jsonl")

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        """The last `result` event of its stream says how it ended."""
        results = [e for e in read_json_lines(run.stdout) if isinstance(e, dict) and e.get("type") == "result"]
        if not results:
            return HarnessOutcome.HARNESS_ERROR
        return RESULTS.get(results[-1].get("subtype"), HarnessOutcome.HARNESS_ERROR)
