"""What the simulated model says: a fixed text (`echo`), or the demo script replaying a patch.

The demo policy drives a harness in the harness's own action format (simulator/action_formats: chosen from the
tools the request offers, text when it offers none): look around, apply the patch (a heredoc `git apply` through the
harness's shell tool; no temp files, since several agents share a host), then finish the way that harness expects
(mini-swe-agent's submit command, a plain text reply, a `finish` call). Turns are counted after the task message, so
few-shot or injected messages before it do not move the script. A run therefore measures the plumbing, not a model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from simulator.config import SimulatorConfig

ECHO_TEXT = "Hello from the evalplane simulator."
UNKNOWN_TEXT = "I do not recognise this task, so I have nothing to do."
LOOK = "git status && ls"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"
PATCH_DELIMITER = "EVALPLANE_PATCH"
NEEDLE_CHARS = 300


@dataclass(frozen=True)
class OfferedTool:
    """A tool the request offers: its name and the JSON schema of its arguments."""

    name: str
    params: dict[str, Any]

    @property
    def properties(self) -> dict[str, Any]:
        props = self.params.get("properties")
        return props if isinstance(props, dict) else {}


@dataclass(frozen=True)
class Conversation:
    """The parts of a request a policy looks at: its messages in order, as (role, text) with role "user" or
    "assistant" (one assistant entry per model turn), and the tools it offers."""

    turns: tuple[tuple[str, str], ...]
    tools: tuple[OfferedTool, ...] = ()
    system: str = ""

    @property
    def user_texts(self) -> list[str]:
        return [text for role, text in self.turns if role == "user"]

    @property
    def assistant_turns(self) -> int:
        return sum(1 for role, _ in self.turns if role == "assistant")

    def turns_after(self, needle: str) -> int:
        """Assistant turns after the first user message whose (normalised) text holds `needle`."""
        for i, (role, text) in enumerate(self.turns):
            if role == "user" and needle in normalise(text):
                return sum(1 for r, _ in self.turns[i + 1:] if r == "assistant")
        return self.assistant_turns


@dataclass(frozen=True)
class ToolCall:
    name: str
    input: dict[str, Any]

    @property
    def arguments(self) -> str:
        return json.dumps(self.input)


@dataclass(frozen=True)
class Reply:
    text: str
    call: ToolCall | None = None  # one tool call, if any, in the tool the request offers (simulator/action_formats)

    @property
    def output_tokens(self) -> int:
        arguments = self.call.arguments if self.call is not None else ""
        return max(1, math.ceil((len(self.text) + len(arguments)) / 4))


class Policy(Protocol):
    def reply(self, conversation: Conversation) -> Reply: ...


class EchoPolicy:
    def reply(self, conversation: Conversation) -> Reply:
        return Reply(ECHO_TEXT)


class Script(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_going: bool = Field(False, description=(
        "after the patch, keep looking around instead of finishing (until a cap of the attempt ends it)"))
    pad_chars: int = Field(0, ge=0, description="text of this many characters added to each turn after the patch")
    command: str | None = Field(None, description=(
        "a shell command the agent runs on its first turn, before the script (e.g. one that allocates memory past"
        " the task's limit); a format without a shell tool looks around instead"))


class Gold(Script):
    action: Literal["gold"]


class Patch(Script):
    action: Literal["patch"]
    patch: str


class Empty(Script):
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
    """Finds the instance by its problem statement in the user messages, then follows the script in the action format
    the request's tools say (simulator/action_formats)."""

    def __init__(self, rules: PolicyFile, instances: list[dict]) -> None:
        self._rules = rules
        self._by_needle = {
            normalise(row["problem_statement"])[:NEEDLE_CHARS]: row
            for row in instances
            if normalise(row.get("problem_statement", ""))
        }

    def reply(self, conversation: Conversation) -> Reply:
        from simulator.action_formats import choose

        fmt = choose(conversation)
        text = normalise("\n".join(conversation.user_texts))
        found = next(((needle, row) for needle, row in self._by_needle.items() if needle in text), None)
        if found is None:
            return fmt.unknown(conversation)
        needle, row = found
        action = self._rules.instances.get(row["instance_id"], self._rules.default)
        turn = conversation.turns_after(needle)
        if not fmt.acts:  # a request without tools (a title, a summary): text only
            return fmt.text(row, conversation)
        if action.command is not None:  # its own turn first; the script follows one turn later
            if turn == 0:
                return fmt.run(action.command, conversation)
            turn -= 1
        patch = None if isinstance(action, Empty) else row["patch"] if isinstance(action, Gold) else action.patch
        if turn == 0:
            return fmt.look(conversation, patch=patch)
        if turn == 1 and patch is not None:
            return fmt.patch(patch, conversation)
        if action.keep_going:
            return fmt.look(conversation, pad=action.pad_chars, patch=patch)
        return fmt.finish(conversation)


class TrajectoryPolicy:
    """An agent's call shape without a task: a seeded number of turns, each reply's size and the tool work it asks
    for (how long the agent works before its next call, how much that work adds to the conversation), drawn like
    real agent trajectories (a few long turns among many short ones: log-normal sizes). The reply's first line says
    what to do: `TRAJECTORY think_s=<s> observe_chars=<n>`, or `TRAJECTORY submit` on the last turn; the rest is
    filler of the drawn output size. Seeded by the first user message, so each attempt replays its trajectory
    whatever else the simulator serves."""

    def __init__(self, seed: int | None = None, shape: TrajectoryShape | None = None) -> None:
        self.seed, self.shape = seed or 0, shape or TrajectoryShape()

    def reply(self, conversation: Conversation) -> Reply:
        import random

        task = conversation.user_texts[0] if conversation.user_texts else ""
        s = self.shape
        turns = random.Random(f"{self.seed}/{task}").randint(s.min_turns, s.max_turns)
        turn = conversation.assistant_turns
        rng = random.Random(f"{self.seed}/{task}/{turn}")
        out_tokens = round(s.draw(rng, s.output_tokens))
        if turn + 1 >= turns:
            head = "TRAJECTORY submit"
        else:
            think, observe = s.draw(rng, s.think_s), round(s.draw(rng, s.observe_tokens))
            head = f"TRAJECTORY think_s={think:.3f} observe_chars={4 * observe}"
        filler = max(0, 4 * out_tokens - len(head) - 1)
        return Reply(head + "\n" + ("lorem ipsum " * (filler // 12 + 1))[:filler])


class TrajectoryShape(BaseModel):
    """Medians of the trajectory policy's draws (each log-normal with `spread`), and its turns (uniform)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_turns: int = Field(20, ge=1)
    max_turns: int = Field(60, ge=1)
    output_tokens: int = Field(250, ge=1)
    observe_tokens: int = Field(700, ge=1)
    think_s: float = Field(0.8, ge=0)
    spread: float = Field(0.6, ge=0)

    def draw(self, rng, median: float) -> float:
        """Log-normal around `median`, clipped to [median / 8, median * 8] (no turn-long outliers)."""
        return min(median * 8, max(median / 8, median * rng.lognormvariate(0, self.spread)))


def load_policy(config: SimulatorConfig) -> Policy:
    if config.policy == "echo":
        return EchoPolicy()
    if config.policy == "trajectory":  # an agent's call shape, for throughput benches (bench/bench_throughput.py)
        return TrajectoryPolicy(config.seed)
    if config.policy == "judge":  # answers a judge's rubric (dispatcher/judge)
        from simulator.judge_policy import JudgePolicy

        return JudgePolicy()
    rules = PolicyFile.model_validate_json(Path(config.policy).read_text())
    assert config.dataset is not None  # guaranteed by SimulatorConfig
    lines = config.dataset.read_text().splitlines()
    demo = DemoPolicy(rules, [json.loads(line) for line in lines if line.strip()])
    if config.red_team is not None:
        from simulator import red_team

        return red_team.load(demo, config.red_team)
    return demo
