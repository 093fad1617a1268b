"""OpenHands on one task, headless: `python3 run_openhands.py TASK_FILE OUT_DIR MAX_ITERATIONS`, in the repository.

The agent is OpenHands' own default one (openhands.tools.preset.default, in CLI mode: terminal, file editor, task
tracker, plus its built-in finish and think), its model configured from the LLM_* environment (LLM_MODEL, LLM_BASE_URL,
LLM_API_KEY, ...) exactly as the `openhands` CLI reads it with --override-with-envs. Unlike the CLI, nothing else
is started: no terminal UI, no update check against the package index, no clone of the public skills repository.

Writes OUT_DIR/trajectory.json (every event of the conversation, as {"harness", "version", "events"} like the other
harnesses' trajectories) and OUT_DIR/status.json (how the run ended); the conversation's own files go under
OUT_DIR/conversations. Runs on OpenHands' Python, never imports the project.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path


def main(task_file: str, out_dir: str, max_iterations: str) -> int:
    from openhands.sdk import LLM, Conversation
    from openhands.tools.preset.default import get_default_agent

    out = Path(out_dir)
    agent = get_default_agent(LLM.load_from_env(), cli_mode=True)
    conversation = Conversation(agent=agent, workspace=str(Path.cwd()), persistence_dir=str(out / "conversations"),
                                max_iteration_per_run=int(max_iterations), visualizer=None)
    error = None
    try:
        conversation.send_message(Path(task_file).read_text())
        conversation.run()
    except Exception as e:  # noqa: BLE001 - the status file says how it ended; the task runner reads it
        error = f"{type(e).__name__}: {e}"
    state = conversation.state
    events = [event.model_dump(mode="json") for event in state.events]
    codes = [e.get("code") for e in events if e.get("kind") == "ConversationErrorEvent"]
    (out / "trajectory.json").write_text(json.dumps(
        {"harness": "openhands", "version": version("openhands-sdk"), "events": events}, default=str))
    (out / "status.json").write_text(json.dumps({
        "execution_status": state.execution_status.value, "error_codes": codes, "error": error}))
    print(f"openhands ended: {state.execution_status.value} {codes} {error or ''}", file=sys.stderr)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
