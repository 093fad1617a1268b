"""mini-swe-agent (and any harness offering some shell tool this package does not know): the command goes to the
shell tool the request offers; the run ends with the submit command, whose output mini-swe-agent takes as the
submission."""

from __future__ import annotations

from simulator.action_formats.base import ShellFormat
from simulator.policy import SUBMIT, Conversation, Reply


class ShellSubmit(ShellFormat):
    name = "shell-submit"

    def matches(self, conversation: Conversation) -> bool:
        return False  # the fallback for requests with tools (simulator.action_formats.choose)

    def finish(self, conversation: Conversation) -> Reply:
        return Reply("THOUGHT: The work is done; let me submit.", self.call(conversation, SUBMIT))
