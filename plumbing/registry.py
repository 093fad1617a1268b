"""Things by name: every seam of the project (backends, launchers, graders, harness adapters) is a Registry.

An entry is registered as "package.module:attr" and imported only when first asked for, so naming a seam never
imports the others (the AWS backend pulls in boto3 clients, the docker grader swebench). A name that is not
registered may itself be a dotted path "package.module:attr" to an implementation kept elsewhere, which is how a
user adds one without touching this project (docs/extending.md).
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(LookupError):
    """The name is neither registered nor an importable "package.module:attr" of the registry's kind."""


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type | None = None) -> None:
        self.kind = kind  # what the names are of, for messages: "launcher", "grader", ...
        self.base = base  # when set, whatever a name resolves to must be this class or a subclass of it
        self._targets: dict[str, str] = {}

    def register(self, name: str, target: str) -> None:
        """`target` is "package.module:attr"; it is imported on first use."""
        if ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: target {target!r} is not 'package.module:attr'")
        self._targets[name] = target

    def names(self) -> list[str]:
        return sorted(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    # read like the dict of registered names it stands for (a dotted path resolves through get, not these)
    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._targets)

    def __getitem__(self, name: str) -> T:
        if name not in self._targets:
            raise KeyError(name)
        return self.get(name)

    def values(self) -> list[T]:
        return [self.get(n) for n in self.names()]

    def items(self) -> list[tuple[str, T]]:
        return [(n, self.get(n)) for n in self.names()]

    def get(self, name: str) -> T:
        target = self._targets.get(name)
        if target is None:
            if ":" not in name:
                raise UnknownName(f"unknown {self.kind} {name!r}: one of {', '.join(self.names())}, "
                                  "or a dotted path 'package.module:Class'")
            target = name
        module, _, attr = target.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise UnknownName(f"{self.kind} {name!r} cannot be loaded: {e}") from None
        if self.base is not None and not (isinstance(obj, type) and issubclass(obj, self.base)):
            raise UnknownName(f"{self.kind} {name!r} is not a {self.base.__name__} subclass")
        return obj
