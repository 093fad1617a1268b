"""A request that offers no tools (opencode's title call, a summary): a short text answer."""

from __future__ import annotations

from simulator.action_formats.base import ShellFormat
from simulator.policy import Conversation


class Text(ShellFormat):
    name = "text"
    acts = False

    def matches(self, conversation: Conversation) -> bool:
        return False  # the fallback for requests without tools (simulator.action_formats.choose)
