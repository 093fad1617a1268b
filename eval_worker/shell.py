"""Shell text as the official eval scripts write it: which lines run, and container paths in them."""

from __future__ import annotations

import re

_HEREDOC = re.compile(r"(?<!<)<<(?!<)-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def shell_lines(script: str) -> list[str]:
    """The script's lines that the shell runs as commands: heredoc bodies (patches) left out."""
    out: list[str] = []
    delims: list[str] = []
    for line in script.split("\n"):
        if delims:
            if line.strip() == delims[0]:
                delims.pop(0)
            continue
        out.append(line)
        delims.extend(m.group(2) for m in _HEREDOC.finditer(line))
    return out


def map_container_paths(script: str, mapping: dict[str, str]) -> str:
    """Rewrite container paths (keys of mapping) to host paths in shell text, except inside heredoc
    bodies. A path only matches as a whole path component sequence (not as part of a longer name)."""
    if not mapping:
        return script
    keys = sorted(mapping, key=len, reverse=True)
    pattern = re.compile(
        r"(?<![\w./-])(" + "|".join(re.escape(k) for k in keys) + r")(?![\w.-])"
    )
    out: list[str] = []
    delims: list[str] = []
    for line in script.split("\n"):
        if delims:
            out.append(line)
            if line.strip() == delims[0]:
                delims.pop(0)
            continue
        out.append(pattern.sub(lambda m: mapping[m.group(1)], line))
        delims.extend(m.group(2) for m in _HEREDOC.finditer(line))
    return "\n".join(out)
