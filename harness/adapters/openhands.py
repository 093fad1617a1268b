"""OpenHands (PyPI openhands-sdk and openhands-tools, on its own Python 3.13), headless, against the shim.

OpenHands needs Python 3.12 or newer; its layer (images/task/harness/openhands) builds CPython from Debian's source
package the way the runtime's is built, and installs the SDK with its tools there. It runs OpenHands' own default
agent (the `openhands` CLI's: terminal, file editor, task tracker, finish, think) through the layer's
run_openhands.py, in /testbed, its model set by the LLM_* environment the CLI reads with --override-with-envs
(LLM_MODEL, LLM_BASE_URL, LLM_API_KEY). The SDK rather than the CLI: the CLI's terminal UI checks the package index
for a newer version on every start and clones its public skills repository from the internet; the SDK does neither
unless asked. Chat completions, not streamed (Anthropic messages for `anthropic/` models).

It caps its own turns (max_iteration_per_run = the attempt's max_turns: it stops with MaxIterationsReached);
cost and time are the shim's and the task runner's. Its trajectory is every event of the conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.models import HarnessOutcome, Job
from harness.adapters.base import Cap, HarnessRun, PipHarness, harness_home, shim_base, write_task

UNBOUNDED_ITERATIONS = 500  # the SDK's default, when the attempt has no turn cap


class OpenHands(PipHarness):
    name = "openhands"
    version = "1.58.2"  # openhands-sdk and openhands-tools
    python = "3.13.5"  # Debian trixie's python3.13 source package, which the layer builds
    sdists = ("func-timeout",)  # an openhands-tools dependency published only as source (pure Python)
    caps = frozenset({Cap.TURNS})

    def python_bin(self) -> str:
        return str(self.install_dir() / "bin" / "python3")

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        home = harness_home(workdir)
        provider = job.model.provider
        env = env | {
            "HOME": str(home), "LANG": "C.UTF-8",
            "LLM_MODEL": f"{provider}/{job.model.model}", "LLM_BASE_URL": shim_base(shim_url, provider),
            "LLM_API_KEY": local_token,
            # the shim retries the provider's 429/529 itself; what reaches OpenHands is final
            "LLM_NUM_RETRIES": "2",
            **({"LLM_MAX_OUTPUT_TOKENS": str(self.settings.max_tokens)} if self.settings.max_tokens else {}),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else LiteLLM fetches its price table from the internet
            "OPENHANDS_SUPPRESS_BANNER": "1", "HF_HUB_OFFLINE": "1",
        }
        turns = job.limits.max_turns or UNBOUNDED_ITERATIONS
        # its files straight in workdir: the task runner uploads workdir/trajectory.json, as for every harness
        argv = [self.python_bin(), str(self.install_dir() / "run_openhands.py"),
                str(write_task(job, self, testbed, workdir)), str(workdir), str(turns)]
        return HarnessRun(argv=argv, env=env, trajectory=workdir / "trajectory.json",
                          extra={"status": str(workdir / "status.json")})

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        """Finished (its finish tool, or a reply without a tool call): submitted; stopped at its iteration limit:
        max_turns_exceeded; anything else (an error, stuck in a loop, no status): the harness's error."""
        try:
            status = json.loads(Path(run.extra["status"]).read_text())
        except (OSError, ValueError):
            return HarnessOutcome.HARNESS_ERROR
        if status.get("execution_status") == "finished" and not status.get("error"):
            return HarnessOutcome.SUBMITTED
        if "MaxIterationsReached" in (status.get("error_codes") or []):
            return HarnessOutcome.MAX_TURNS_EXCEEDED
        return HarnessOutcome.HARNESS_ERROR
