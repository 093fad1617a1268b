"""What the simulated model says: a fixed text (`echo`), or the demo script replaying a patch.

The demo policy drives a harness through its shell tool (the one the request offers: mini-swe-agent's
`bash`, Codex CLI's `exec_command`, ...): look around, apply the patch with a heredoc (no temp files,
since several agents share a host), then submit with `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git
diff`, whose output mini-swe-agent takes as the submission. A run therefore measures the plumbing, not a
model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from simulator.config import SimulatorConfig

ECHO_TEXT = "Hello from the evalplane simulator."
UNKNOWN_TEXT = "I do not recognise this task, so I have nothing to do."
LOOK = "git status && ls"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"
PATCH_DELIMITER = "EVALPLANE_PATCH"
NEEDLE_CHARS = 300


@dataclass(frozen=True)
class Conversation:
    """The parts of a request a policy looks at."""

    user_texts: list[str]
    assistant_turns: int


@dataclass(frozen=True)
class Reply:
    text: str
    command: str | None = None  # one shell tool call, if any (to the tool the request offers: simulator/wire.py)

    @property
    def output_tokens(self) -> int:
        arguments = json.dumps({"command": self.command}) if self.command is not None else ""
        return max(1, math.ceil((len(self.text) + len(arguments)) / 4))


class Policy(Protocol):
    def reply(self, conversation: Conversation) -> Reply: ...


class EchoPolicy:
    def reply(self, conversation: Conversation) -> Reply:
        return Reply(ECHO_TEXT)


class Gold(BaseModel):
    action: Literal["gold"]


class Patch(BaseModel):
    action: Literal["patch"]
    patch: str


class Empty(BaseModel):
    action: Literal["empty"]


Action = Annotated[Gold | Patch | Empty, Field(discriminator="action")]


class PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default: Action = Gold(action="gold")
    instances: dict[str, Action] = {}


def normalise(text: str) -> str:
    return " ".join(text.split())


def apply_command(patch: str) -> str:
    return f"git apply <<'{PATCH_DELIMITER}'\n{patch.rstrip(chr(10))}\n{PATCH_DELIMITER}"


class DemoPolicy:
    """Finds the instance by its problem statement in the user messages, then follows the script."""

    def __init__(self, rules: PolicyFile, instances: list[dict]) -> None:
        self._rules = rules
        self._by_needle = {
            normalise(row["problem_statement"])[:NEEDLE_CHARS]: row
            for row in instances
            if normalise(row.get("problem_statement", ""))
        }

    def reply(self, conversation: Conversation) -> Reply:
        text = normalise("\n".join(conversation.user_texts))
        row = next((row for needle, row in self._by_needle.items() if needle in text), None)
        if row is None:
            return Reply(UNKNOWN_TEXT)
        action = self._rules.instances.get(row["instance_id"], self._rules.default)
        turn = conversation.assistant_turns
        if turn == 0:
            return Reply("THOUGHT: Let me look at the repository first.", LOOK)
        if turn == 1 and not isinstance(action, Empty):
            patch = row["patch"] if isinstance(action, Gold) else action.patch
            return Reply("THOUGHT: I know the fix; let me apply it.", apply_command(patch))
        return Reply("THOUGHT: The work is done; let me submit.", SUBMIT)


def load_policy(config: SimulatorConfig) -> Policy:
    if config.policy == "echo":
        return EchoPolicy()
    if config.policy == "judge":  # answers a judge's rubric (dispatcher/judge)
        from simulator.judge_policy import JudgePolicy

        return JudgePolicy()
    rules = PolicyFile.model_validate_json(Path(config.policy).read_text())
    assert config.dataset is not None  # guaranteed by SimulatorConfig
    lines = config.dataset.read_text().splitlines()
    return DemoPolicy(rules, [json.loads(line) for line in lines if line.strip()])
