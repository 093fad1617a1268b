"""opencode (npm opencode-ai, its native binary), headless, against the shim (chat completions or messages).

`opencode run --format json`, the task on stdin, configured by $OPENCODE_CONFIG (written here, outside /testbed):
one provider at the shim, `"snapshot": false` (else it keeps a shadow git copy of the repository), autoupdate and
sharing off, every tool allowed but web fetches, its background plugin install kept offline. Its step cap is soft (it injects a message and goes on), so it caps
nothing itself: the shim's caps end its sessions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from contract.models import HarnessOutcome, Job
from harness.adapters.base import HarnessRun, NpmHarness, harness_home, read_json_lines, write_task

TOKEN_ENV = "EVALPLANE_SHIM_TOKEN"
PROVIDER = "evalplane"
SDK = {"openai": "@ai-sdk/openai-compatible", "anthropic": "@ai-sdk/anthropic"}


def config(model: str, provider: str, base_url: str, max_tokens: int | None) -> dict:
    return {
        "$schema": "https://opencode.ai/config.json",
        "model": f"{PROVIDER}/{model}", "small_model": f"{PROVIDER}/{model}",
        "autoupdate": False, "share": "disabled", "snapshot": False,
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        "provider": {PROVIDER: {
            "npm": SDK[provider], "name": PROVIDER,
            "options": {"baseURL": base_url, "apiKey": "{env:" + TOKEN_ENV + "}"},
            "models": {model: {"name": model, "tool_call": True,
                               "limit": {"context": 200000, "output": max_tokens or 8192}}},
        }},
    }


class Opencode(NpmHarness):
    name = "opencode"
    version = "1.18.33"
    npm_package = "opencode-ai"
    binaries: ClassVar[dict[str, str]] = {"opencode": "opencode-linux-x64/bin/opencode"}

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        home = harness_home(workdir)
        cfg = workdir / "opencode.json"
        cfg.write_text(json.dumps(config(job.model.model, job.model.provider, shim_url + "/v1",
                                         self.settings.max_tokens), indent=1))
        env = env | {
            "HOME": str(home), "LANG": "C.UTF-8", "OPENCODE_CONFIG": str(cfg), TOKEN_ENV: local_token,
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
            **{f"OPENCODE_DISABLE_{k}": "1" for k in ("AUTOUPDATE", "MODELS_FETCH", "SHARE", "LSP_DOWNLOAD",
                                                      "DEFAULT_PLUGINS")},
            # it installs its plugin package into each config folder in the background, from the npm registry:
            # offline, its npm finds the cache empty and gives up without a connection
            "npm_config_offline": "true",
        }
        argv = [self.executable(), "run", "--format", "json", "--model", f"{PROVIDER}/{job.model.model}"]
        return HarnessRun(argv=argv, env=env, trajectory=workdir / "trajectory.json",
                          stdin=write_task(job, self, testbed, workdir), stdout=workdir / "opencode.jsonl")

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        """Exit 0 after at least one step, without an error event: submitted."""
        events = [e for e in read_json_lines(run.stdout) if isinstance(e, dict)]
        kinds = [e.get("type") for e in events]
        if exit_code == 0 and "step_finish" in kinds and "error" not in kinds:
            return HarnessOutcome.SUBMITTED
        return HarnessOutcome.HARNESS_ERROR
