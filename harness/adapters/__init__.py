"""Harness adapters by name: one module per harness (the layout is in harness/adapters/base.py's docstring).

A spec's `harness.name` is a name registered here, or a dotted path "package.module:Class" to an adapter class kept
elsewhere (it must be importable inside the task image too). Adding a harness: its module, and one line below.
"""

from __future__ import annotations

from harness.adapters.base import Cap, HarnessAdapter, HarnessRun, HarnessSettings
from plumbing.registry import Registry, UnknownName

ADAPTERS: Registry[type[HarnessAdapter]] = Registry("harness", base=HarnessAdapter)
ADAPTERS.register("mini-swe-agent", "harness.adapters.mini_swe_agent:MiniSweAgent")
ADAPTERS.register("claude-code", "harness.adapters.claude_code:ClaudeCode")
ADAPTERS.register("codex", "harness.adapters.codex:Codex")
ADAPTERS.register("opencode", "harness.adapters.opencode:Opencode")
ADAPTERS.register("aider", "harness.adapters.aider:Aider")
ADAPTERS.register("openhands", "harness.adapters.openhands:OpenHands")

UnknownHarness = UnknownName  # the name callers catch


def load_adapter(name: str) -> type[HarnessAdapter]:
    return ADAPTERS.get(name)


__all__ = ["ADAPTERS", "Cap", "HarnessAdapter", "HarnessRun", "HarnessSettings", "UnknownHarness", "load_adapter"]
