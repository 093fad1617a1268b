"""Aider (PyPI aider-chat, in its own virtual environment of the runtime's Python), headless, against the shim.

`aider --message-file TASK --yes-always --edit-format udiff ...` in /testbed: one message, then it exits. It has no
tools: the model answers in text, and Aider applies the fenced udiff blocks of the answer itself. A turn of Aider's
is one model call: its answer to the task, then each reflection Aider makes on its own (it added files the answer
named to the chat, an edit did not apply, lint errors), at most three, so a run is one to four calls; it caps none
of them itself, the shim's caps end its sessions.

Configured, never patched: the shim as its OpenAI (OPENAI_API_BASE) or Anthropic (ANTHROPIC_API_BASE) endpoint; no
commits (--no-auto-commits, --no-dirty-commits), nothing written into the repository (no .gitignore entry, no repo
map cache, its history files under the task's workdir); no update check, analytics, release notes or URL scraping;
the model's metadata handed to it from the runtime's LiteLLM price table, else it fetches LiteLLM's from the internet.
It sends no output cap of its own (settings.max_tokens is not passed: a model-settings file would replace Aider's own
settings for the model).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from contract import pricing
from contract.models import HarnessOutcome, Job
from harness.adapters.base import HarnessRun, HarnessSettings, PipHarness, harness_home, shim_base, write_task


class AiderSettings(HarnessSettings):
    edit_format: str = Field("udiff", pattern=r"^(udiff|diff|whole|diff-fenced)$",
                             description="how the model writes edits: udiff, diff (SEARCH/REPLACE), whole, diff-fenced")
    auto_lint: bool = Field(True, description="lint edited files and ask the model to fix what the linter finds")


def model_metadata(provider: str, model: str) -> dict:
    """The model's entry from the runtime's LiteLLM price table, under the name Aider looks it up by: with it, Aider
    asks nobody for model information. An unknown model gets a context window that is surely enough."""
    try:
        table = json.loads(pricing.price_file().read_text())
    except (OSError, ValueError):
        table = {}
    entry = next((dict(table[n]) for n in (model, f"{provider}/{model}") if isinstance(table.get(n), dict)),
                 {"max_input_tokens": 128_000, "max_output_tokens": 8192, "input_cost_per_token": 0.0,
                  "output_cost_per_token": 0.0, "mode": "chat"})
    entry.setdefault("litellm_provider", provider)
    return {f"{provider}/{model}": entry}


class Aider(PipHarness):
    name = "aider"
    version = "0.86.2"
    python = "3.11.2"  # the runtime's own interpreter (images/task/Dockerfile.runtime); its venv is under the layer
    Settings = AiderSettings
    scratch = (".aider.chat.history.md", ".aider.input.history", ".aider.llm.history", ".aider.tags.cache.v4")

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        home = harness_home(workdir)
        provider, model = job.model.provider, job.model.model
        meta = workdir / "aider.model-metadata.json"
        meta.write_text(json.dumps(model_metadata(provider, model)))
        key = {"openai": "OPENAI", "anthropic": "ANTHROPIC"}[provider]
        env = env | {
            "HOME": str(home), "LANG": "C.UTF-8", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            f"{key}_API_BASE": shim_base(shim_url, provider), f"{key}_API_KEY": local_token,
        }
        argv = [str(self.install_dir() / "bin" / "aider"),
                "--message-file", str(write_task(job, self, testbed, workdir)),
                "--model", f"{provider}/{model}", "--edit-format", self.settings.edit_format,
                "--yes-always", "--no-auto-commits", "--no-dirty-commits", "--no-gitignore", "--no-check-update",
                "--analytics-disable", "--no-show-release-notes", "--no-show-model-warnings", "--no-detect-urls",
                "--no-pretty", "--no-fancy-input",
                "--auto-lint" if self.settings.auto_lint else "--no-auto-lint",
                "--map-tokens", "0", "--model-metadata-file", str(meta),
                "--llm-history-file", str(workdir / "aider.llm.history"),
                "--chat-history-file", str(workdir / "aider.chat.history.md"),
                "--input-history-file", str(workdir / "aider.input.history")]
        return HarnessRun(argv=argv, env=env, trajectory=workdir / "trajectory.json",
                          extra={"llm_history": str(workdir / "aider.llm.history"),
                                 "chat_history": str(workdir / "aider.chat.history.md")})

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        """It answers its one message and exits 0 (an error from the model's endpoint also ends its run, reported in
        its output): submitted; anything else is the harness's error."""
        return HarnessOutcome.SUBMITTED if exit_code == 0 else HarnessOutcome.HARNESS_ERROR

    def collect(self, run: HarnessRun) -> None:
        """The trajectory: Aider's raw model log (every message sent and received) and its chat transcript."""
        def text(key: str) -> str:
            p = Path(run.extra[key])
            return p.read_text(errors="replace") if p.exists() else ""

        run.trajectory.write_text(json.dumps({"harness": self.name, "version": self.version,
                                              "llm_history": text("llm_history"), "chat": text("chat_history")}))
