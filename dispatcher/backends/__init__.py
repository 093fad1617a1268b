"""Backends: where a run's tasks, queues, keys and graders live (base.Backend), by name in BACKENDS; and the helpers
the backends share (daemons, local_services, moto_server, stack_outputs, resources)."""

from __future__ import annotations

from dispatcher.backends.base import Backend
from plumbing.registry import Registry

BACKENDS: Registry[type[Backend]] = Registry("backend", base=Backend)
BACKENDS.register("local", "dispatcher.backends.local:LocalBackend")
BACKENDS.register("aws", "dispatcher.backends.aws:AwsBackend")


def for_spec(spec) -> Backend:
    """The spec's backend (backend.kind: a registered name or a dotted path). The one way to get it."""
    return BACKENDS.get(spec.backend.kind)(spec)


__all__ = ["BACKENDS", "Backend", "for_spec"]
