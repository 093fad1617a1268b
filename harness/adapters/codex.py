"""Codex CLI (npm @openai/codex, its static binary), headless, against the shim's /v1/responses.

`codex exec --json`, the task on stdin, configured by $CODEX_HOME/config.toml (written here, outside /testbed): a
provider at the shim with `wire_api = "responses"` (its only wire format), bounded retries (it retries a refused
connection forever otherwise; the shim absorbs the provider's 429/529 itself), and update checks, analytics,
feedback, plugins, apps and web search off. It caps nothing itself: the shim's caps end its sessions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from contract.models import HarnessOutcome, Job
from harness.adapters.base import HarnessRun, NpmHarness, harness_home, read_json_lines, write_task

TOKEN_ENV = "EVALPLANE_SHIM_TOKEN"  # the variable holding the shim's local token (never the provider key)


def _toml(value: object) -> str:
    return json.dumps(value)  # a JSON string or number is a TOML one


def config_toml(model: str, base_url: str, max_tokens: int | None) -> str:
    lines = [
        f"model = {_toml(model)}",
        'model_provider = "evalplane"',
        "check_for_update_on_startup = false",
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        'web_search = "disabled"',
        "hide_agent_reasoning = true",
        *([f"model_max_output_tokens = {int(max_tokens)}"] if max_tokens else []),
        "",
        "[model_providers.evalplane]",
        'name = "evalplane shim"',
        f"base_url = {_toml(base_url)}",
        f"env_key = {_toml(TOKEN_ENV)}",
        'wire_api = "responses"',
        "request_max_retries = 2",
        "stream_max_retries = 2",
        "",
        "[analytics]", "enabled = false", "",
        "[feedback]", "enabled = false", "",
        "[history]", 'persistence = "none"', "",
        "[features]",
        *(f"{f} = false" for f in ("unbounded_connection_retries", "plugins", "remote_plugin", "apps", "multi_agent",
                                   "goals", "image_generation", "in_app_updates", "tool_suggest")),
        "",
    ]
    return "\n".join(lines)


class Codex(NpmHarness):
    name = "codex"
    version = "0.169.0"
    npm_package = "@openai/codex"
    binaries: ClassVar[dict[str, str]] = {
        "codex": "@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
        "rg": "@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/codex-path/rg",
    }
    providers = ("openai",)

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        home = harness_home(workdir)
        codex_home = workdir / "codex-home"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(config_toml(job.model.model, shim_url + "/v1", self.settings.max_tokens))
        bin_dir = str(self.install_dir() / "bin")
        env = env | {
            "HOME": str(home), "LANG": "C.UTF-8", "CODEX_HOME": str(codex_home), TOKEN_ENV: local_token,
            "PATH": f"{env.get('PATH', '/usr/bin:/bin')}:{bin_dir}",  # its rg, after the instance's own tools
        }
        argv = [self.executable(), "exec", "--json", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "-m", job.model.model, "-C", str(testbed), "-"]
        return HarnessRun(argv=argv, env=env, trajectory=workdir / "trajectory.json",
                          stdin=write_task(job, self, testbed, workdir), stdout=workdir / "codex.jsonl")

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        """Its last turn completed (exit 0): submitted; a failed turn or anything else: the harness's error."""
        kinds = [e.get("type") for e in read_json_lines(run.stdout) if isinstance(e, dict)]
        if exit_code == 0 and "turn.completed" in kinds and kinds[-1] != "turn.failed":
            return HarnessOutcome.SUBMITTED
        return HarnessOutcome.HARNESS_ERROR
