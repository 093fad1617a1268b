"""Harness adapters by name: one module per harness (the layout is in harness/adapters/base.py's docstring).

A spec's `harness.name` is a key of ADAPTERS, or a dotted path "package.module:Class" to an adapter class kept
elsewhere (it must be importable inside the task image too)."""

from __future__ import annotations

import importlib

from harness.adapters.base import Cap, HarnessAdapter, HarnessRun, HarnessSettings
from harness.adapters.claude_code import ClaudeCode
from harness.adapters.codex import Codex
from harness.adapters.mini_swe_agent import MiniSweAgent
from harness.adapters.opencode import Opencode

ADAPTERS: dict[str, type[HarnessAdapter]] = {
    a.name: a for a in (MiniSweAgent, ClaudeCode, Codex, Opencode)
}


class UnknownHarness(LookupError):
    """The name is neither a registered harness nor an importable "package.module:Class" adapter."""


def load_adapter(name: str) -> type[HarnessAdapter]:
    if name in ADAPTERS:
        return ADAPTERS[name]
    if ":" not in name:
        raise UnknownHarness(f"unknown harness {name!r}: one of {', '.join(sorted(ADAPTERS))}, "
                             "or a dotted path 'package.module:Class'")
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownHarness(f"harness {name!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, HarnessAdapter)):
        raise UnknownHarness(f"harness {name!r} is not a HarnessAdapter subclass")
    return cls


__all__ = ["ADAPTERS", "Cap", "HarnessAdapter", "HarnessRun", "HarnessSettings", "UnknownHarness", "load_adapter"]
