"""What an action format is, and the shell-tool helpers most formats share."""

from __future__ import annotations

from typing import Any, Protocol

from simulator.policy import LOOK, UNKNOWN_TEXT, Conversation, OfferedTool, Reply, ToolCall, apply_command

COMMAND_ARGS = ("command", "cmd")
_PREFERENCES = (  # a tool taking the command as a string, else as an argv, else any string argument
    lambda arg, spec: arg in COMMAND_ARGS and spec.get("type") == "string",
    lambda arg, spec: arg in COMMAND_ARGS and spec.get("type") == "array",
    lambda arg, spec: spec.get("type") == "string",
)


class ActionFormat(Protocol):
    name: str
    acts: bool  # False: the request offers no way to act (answer with text only)

    def matches(self, conversation: Conversation) -> bool: ...
    def look(self, conversation: Conversation, pad: int = 0, patch: str | None = None) -> Reply:
        """patch: the one the script applies (None: it applies none), for formats that must first ask for its files."""
    def patch(self, patch: str, conversation: Conversation) -> Reply: ...
    def run(self, command: str, conversation: Conversation) -> Reply:
        """A shell command of the script's own (formats without a shell tool look around instead)."""
    def finish(self, conversation: Conversation) -> Reply: ...
    def text(self, row: dict, conversation: Conversation) -> Reply: ...
    def unknown(self, conversation: Conversation) -> Reply: ...


def offers(conversation: Conversation, name: str, *args: str) -> OfferedTool | None:
    """The offered tool `name` if it takes every argument in `args`."""
    for tool in conversation.tools:
        if tool.name == name and all(a in tool.properties for a in args):
            return tool
    return None


def shell_call(conversation: Conversation, command: str) -> ToolCall:
    """`command` as a call of the request's shell tool: a string argument `command`/`cmd`, else an argv one (run as
    `bash -lc COMMAND`), else any string argument; `bash` with `command` when nothing fits."""
    found = [(t.name, arg, spec) for t in conversation.tools for arg, spec in t.properties.items()
             if isinstance(spec, dict)]
    for wanted in _PREFERENCES:
        for name, arg, spec in found:
            if wanted(arg, spec):
                value: Any = ["bash", "-lc", command] if spec.get("type") == "array" else command
                return ToolCall(name, {arg: value})
    return ToolCall("bash", {"command": command})


def pad_text(text: str, pad: int) -> str:
    return text if pad <= 0 else text + "\n" + ("Still thinking about it. " * (pad // 25 + 1))[:pad]


class TextReplies:
    """The replies most formats give alike: the run ends with a text answer, a request without tools gets a title,
    an unrecognised one the policy's unknown text."""

    def finish(self, conversation: Conversation) -> Reply:
        return Reply("The fix is applied: the change is in the working tree. I am done.")

    def text(self, row: dict, conversation: Conversation) -> Reply:
        return Reply(f"Fix {row['instance_id']}")

    def unknown(self, conversation: Conversation) -> Reply:
        return Reply(UNKNOWN_TEXT)


class ShellFormat(TextReplies):
    """A harness that acts through one shell tool: look and patch are shell commands; the finish step is the
    subclass's (a text reply by default)."""

    name = "shell"
    acts = True
    tool_name: str | None = None  # the shell tool this format calls; None: whichever the request offers
    arg = "command"

    def matches(self, conversation: Conversation) -> bool:
        raise NotImplementedError

    def call(self, conversation: Conversation, command: str) -> ToolCall:
        if self.tool_name is not None:
            return ToolCall(self.tool_name, {self.arg: command})
        return shell_call(conversation, command)

    def look(self, conversation: Conversation, pad: int = 0, patch: str | None = None) -> Reply:
        return Reply(pad_text("THOUGHT: Let me look at the repository first.", pad), self.call(conversation, LOOK))

    def patch(self, patch: str, conversation: Conversation) -> Reply:
        return Reply("THOUGHT: I know the fix; let me apply it.", self.call(conversation, apply_command(patch)))

    def run(self, command: str, conversation: Conversation) -> Reply:
        return Reply("THOUGHT: Let me run this first.", self.call(conversation, command))
