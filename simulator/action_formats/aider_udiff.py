"""Aider with `--edit-format udiff`: no tools; its system prompt asks for edits "similar to unified diffs that `diff
-U0` would produce", and it applies the fenced ```diff blocks of a plain text answer itself.

Aider calls the model again only when it has something to reflect on, so the script takes its shape:
  * look: the answer names the files the patch changes; Aider adds them to the chat and asks again (a reflection);
  * patch: the patch as udiff blocks, one per file (`--- a/PATH` / `+++ b/PATH`, which Aider reads as PATH); Aider
    applies them, and unless a hunk failed or the linter complained, its run ends there;
  * finish: a text answer without any diff (nothing more to apply);
  * looking again after the patch (only reachable when Aider reflects on a failed hunk): the answer re-sends a hunk
    that cannot apply (`STALE`), so that Aider reflects again until a cap of the attempt or its own limit of three
    reflections ends the run; it never touches the files.
A file deletion cannot be written this way (Aider's udiff has no deletion); new files can (`--- /dev/null`).
"""

from __future__ import annotations

import re

from simulator.action_formats.base import TextReplies, pad_text
from simulator.policy import Conversation, Reply

SYSTEM_MARKER = "diff -U0"  # in Aider's udiff system prompt ("... unified diffs that `diff -U0` would produce")
ASK = "Before I change anything, please add these files to the chat:"
STALE = "-@@@ evalplane ~~ 7f3a9c2e ~~ a line that is in no file, so this hunk never applies ~~ 7f3a9c2e @@@\n"
_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def file_sections(patch: str) -> list[tuple[str, str]]:
    """(path, its `--- ... +++ ... @@ ...` text) for each file of a git diff, in order."""
    starts = [(m.start(), m.group(2)) for m in _FILE.finditer(patch)]
    out = []
    for i, (start, path) in enumerate(starts):
        body = patch[start:starts[i + 1][0] if i + 1 < len(starts) else len(patch)]
        head = body.find("\n--- ")
        if head >= 0:
            out.append((path, body[head + 1:].rstrip("\n") + "\n"))
    if not starts and patch.lstrip().startswith("--- "):  # a bare unified diff (no `diff --git` lines)
        first = re.search(r"^\+\+\+ (?:b/)?(\S+)", patch, re.MULTILINE)
        out.append((first.group(1) if first else "", patch.strip("\n") + "\n"))
    return out


def changed_files(patch: str) -> list[str]:
    """The files the patch changes that exist before it (those Aider can add to the chat)."""
    return [path for path, text in file_sections(patch) if not text.startswith("--- /dev/null")]


def udiff_blocks(sections: list[tuple[str, str]]) -> str:
    return "\n".join(f"```diff\n{text}```\n" for _, text in sections)


class AiderUdiff(TextReplies):
    name = "aider-udiff"
    acts = True

    def matches(self, conversation: Conversation) -> bool:
        return not conversation.tools and SYSTEM_MARKER in conversation.system

    def look(self, conversation: Conversation, pad: int = 0, patch: str | None = None) -> Reply:
        files = changed_files(patch or "")
        asked = any(role == "assistant" and ASK in text for role, text in conversation.turns)
        if files and not asked:
            return Reply(pad_text(f"{ASK} {' '.join(files)}", pad))
        if files:  # the files are in the chat already: insist on a hunk that cannot apply (see the module doc)
            stale = f"--- a/{files[0]}\n+++ b/{files[0]}\n@@ @@\n{STALE}"
            return Reply(pad_text("Let me try that edit once more.\n\n" + udiff_blocks([(files[0], stale)]), pad))
        return Reply(pad_text("I looked at the repository and I see nothing that needs a change.", pad))

    def run(self, command: str, conversation: Conversation) -> Reply:
        return self.look(conversation)  # aider runs no shell command of the model's

    def patch(self, patch: str, conversation: Conversation) -> Reply:
        return Reply("I know the fix; here are the changes.\n\n" + udiff_blocks(file_sections(patch)))
