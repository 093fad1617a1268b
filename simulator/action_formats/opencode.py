"""opencode: `bash` `{command}` beside its `edit` `{filePath, ...}` and `todowrite` tools; a text reply without a
tool call ends the run (answering its submit-less loop with the submit command would go on forever). Its extra
title call offers no tools and gets the `text` format."""

from __future__ import annotations

from simulator.action_formats.base import ShellFormat, offers
from simulator.policy import Conversation


class Opencode(ShellFormat):
    name = "opencode"
    tool_name, arg = "bash", "command"

    def matches(self, conversation: Conversation) -> bool:
        return offers(conversation, "bash", "command") is not None and (
            offers(conversation, "edit", "filePath") is not None or offers(conversation, "todowrite") is not None)
