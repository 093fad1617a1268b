"""Action formats: how each harness expects the model to act, one module per format, chosen from the request.

A format says which requests it recognises (`matches`: the tool names and argument keys the request offers, or its
system prompt), which tool a shell command goes to, how the patch is applied, and what ends the harness's run (the
submit command, a plain text reply, a `finish` call). The demo policy (simulator/policy.py) runs the same script in
every format: look, apply the patch, finish. FORMATS is tried in order; the first that matches is used, else
`shell_submit` for a request with tools and `text` for one without.

Adding a format: a module here with a class following ActionFormat (simulator/action_formats/base.py), one entry in
FORMATS, placed before any broader format that would also match its requests.
"""

from __future__ import annotations

from simulator.action_formats.base import ActionFormat
from simulator.action_formats.claude_code import ClaudeCode
from simulator.action_formats.codex import Codex
from simulator.action_formats.opencode import Opencode
from simulator.action_formats.shell_submit import ShellSubmit
from simulator.action_formats.text import Text
from simulator.policy import Conversation

FORMATS: dict[str, ActionFormat] = {
    "claude-code": ClaudeCode(),
    "codex": Codex(),
    "opencode": Opencode(),
    "shell-submit": ShellSubmit(),
    "text": Text(),
}
FALLBACK_WITH_TOOLS, FALLBACK_WITHOUT_TOOLS = "shell-submit", "text"


def choose(conversation: Conversation) -> ActionFormat:
    for fmt in FORMATS.values():
        if fmt.matches(conversation):
            return fmt
    return FORMATS[FALLBACK_WITH_TOOLS if conversation.tools else FALLBACK_WITHOUT_TOOLS]


__all__ = ["FORMATS", "ActionFormat", "choose"]
