"""OpenHands: `terminal` `{command, security_risk, summary}` (it rejects a call without `security_risk`, one of the
levels its schema lists) beside `file_editor`, and a `finish` `{message}` tool that ends its run. Looking around
again (after the patch, until a cap) numbers each command: OpenHands ends a run as stuck after four identical
actions with identical results."""

from __future__ import annotations

from simulator.action_formats.base import ShellFormat, offers, pad_text
from simulator.policy import LOOK, Conversation, Reply, ToolCall

RISK = "LOW"  # a repository command or `git apply`: the level OpenHands itself gives such actions


class OpenHandsTerminal(ShellFormat):
    name = "openhands-terminal"
    tool_name, arg = "terminal", "command"

    def matches(self, conversation: Conversation) -> bool:
        return offers(conversation, "terminal", "command") is not None and offers(conversation, "finish") is not None

    def call(self, conversation: Conversation, command: str) -> ToolCall:
        args: dict = {"command": command}
        props = offers(conversation, "terminal", "command").properties  # matches() found it
        if "security_risk" in props:
            levels = props["security_risk"].get("enum") or [RISK]
            args["security_risk"] = RISK if RISK in levels else levels[0]
        if "summary" in props:
            args["summary"] = command.splitlines()[0][:60]
        return ToolCall("terminal", args)

    def look(self, conversation: Conversation, pad: int = 0, patch: str | None = None) -> Reply:
        n = conversation.assistant_turns
        command = LOOK if n == 0 else f"{LOOK}  # look {n + 1}"
        return Reply(pad_text("THOUGHT: Let me look at the repository first.", pad), self.call(conversation, command))

    def finish(self, conversation: Conversation) -> Reply:
        return Reply("The fix is applied.", ToolCall("finish", {"message": "The fix is applied: the change is in the "
                                                                           "working tree. I am done."}))
