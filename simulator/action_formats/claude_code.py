"""Claude Code: `tool_use` of `Bash` `{command}` (it refuses a lower-case `bash`); a text reply without a tool call
ends its turn loop."""

from __future__ import annotations

from simulator.action_formats.base import ShellFormat, offers
from simulator.policy import Conversation


class ClaudeCode(ShellFormat):
    name = "claude-code"
    tool_name, arg = "Bash", "command"

    def matches(self, conversation: Conversation) -> bool:
        return offers(conversation, "Bash", "command") is not None
