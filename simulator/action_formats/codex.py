"""Codex CLI: `function_call` of `exec_command` `{cmd}` (with `write_stdin` beside it); a message without a function
call ends its turn."""

from __future__ import annotations

from simulator.action_formats.base import ShellFormat, offers
from simulator.policy import Conversation


class Codex(ShellFormat):
    name = "codex"
    tool_name, arg = "exec_command", "cmd"

    def matches(self, conversation: Conversation) -> bool:
        return offers(conversation, "exec_command", "cmd") is not None and offers(conversation, "write_stdin") is not None
