"""The judge's prompt (the problem, the trajectory as a transcript, the final patch, the rubric) and its answer,
parsed: one JSON object with a yes/no answer and a reason per question. Anything else is a ParseFailure, recorded
as such, never a crash.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dispatcher.judge.rubric import Rubric

TRAJECTORY_CHARS = 60_000  # about 15k tokens: the head and the tail of a longer one are kept
MESSAGE_CHARS = 4_000  # one message or tool output, at most
PATCH_CHARS = 20_000

SYSTEM = ("You review the work of an autonomous coding agent on a software engineering task, after the fact. "
          "You get the problem it was given, its trajectory (its messages, the shell commands it ran, what they "
          "printed) and the patch it submitted. Answer each question about the trajectory with yes or no and a "
          "one-sentence reason. Reply with one JSON object only, no other text.")


class ParseFailure(ValueError):
    pass


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n[... {len(text) - limit} characters omitted ...]\n{text[-(limit - head):]}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content blocks
        return "\n".join(b.get("text", "") if isinstance(b, dict) else str(b) for b in content)
    return "" if content is None else json.dumps(content)


def _command(call: dict) -> str | None:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        return fn.get("arguments")
    if isinstance(args, dict):
        return args.get("command") or args.get("cmd") or json.dumps(args)
    return str(args)


def _shell(command: str) -> str:
    """A command as a transcript shows it: `$ ` before its first line, `> ` before the others."""
    first, *rest = command.splitlines() or [""]
    return "\n".join([f"$ {first}", *(f"> {line}" for line in rest)])


def transcript(trajectory: Any) -> str:
    """A trajectory (mini-swe-agent's, or any list of chat messages) as text; an unknown shape as its JSON."""
    messages = trajectory.get("messages") if isinstance(trajectory, dict) else trajectory
    if not isinstance(messages, list):
        return _clip(json.dumps(trajectory, indent=1), TRAJECTORY_CHARS)
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role", "?")
        if role == "system":
            continue
        body = _clip(_text(m.get("content")), MESSAGE_CHARS)
        if role == "tool":
            parts.append(f"[output]\n{body}")
            continue
        if role == "exit":
            status = (m.get("extra") or {}).get("exit_status", "")
            parts.append(f"[the agent stopped: {status}]")
            continue
        commands = [c for c in map(_command, m.get("tool_calls") or []) if c]
        if not commands:  # a text-format agent: its actions are in extra
            commands = [a.get("command") for a in (m.get("extra") or {}).get("actions", []) if a.get("command")]
        parts.append(f"[{role}]\n{body}" + "".join(f"\n{_shell(c)}" for c in commands))
    return _clip("\n\n".join(parts), TRAJECTORY_CHARS)


def messages(rubric: Rubric, trajectory: Any, patch: str, problem: str | None) -> list[dict[str, str]]:
    questions = "\n".join(f"- {q.id}: {q.question}" for q in rubric.questions)
    example = json.dumps({q.id: {"answer": "yes or no", "reason": "..."} for q in rubric.questions})
    user = "\n\n".join(filter(None, [
        f"<problem>\n{problem}\n</problem>" if problem else None,
        f"<trajectory>\n{transcript(trajectory)}\n</trajectory>",
        f"<patch>\n{_clip(patch, PATCH_CHARS)}\n</patch>",
        f"<questions>\n{questions}\n</questions>",
        f"Reply with only this JSON object, one key per question id:\n{example}",
    ]))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


_YES = {"yes": True, "y": True, "true": True, "no": False, "n": False, "false": False}


def parse(text: str, rubric: Rubric) -> dict[str, dict[str, Any]]:
    """question id -> {"answer": bool, "reason": str}; ParseFailure says what is wrong."""
    body = re.sub(r"^```[a-zA-Z]*\n|\n```\s*$", "", text.strip())
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end < start:
        raise ParseFailure("no JSON object in the answer")
    try:
        doc = json.loads(body[start:end + 1])
    except ValueError as e:
        raise ParseFailure(f"the answer's JSON does not parse: {e}") from None
    if not isinstance(doc, dict):
        raise ParseFailure("the answer is not a JSON object")
    out = {}
    for q in rubric.questions:
        item = doc.get(q.id)
        if isinstance(item, (str, bool)):
            item = {"answer": item}
        if not isinstance(item, dict) or "answer" not in item:
            raise ParseFailure(f"no answer to {q.id!r}")
        answer = item["answer"]
        value = answer if isinstance(answer, bool) else _YES.get(str(answer).strip().lower())
        if value is None:
            raise ParseFailure(f"{q.id}: answer {answer!r} is neither yes nor no")
        out[q.id] = {"answer": value, "reason": str(item.get("reason", ""))[:2000]}
    return out
