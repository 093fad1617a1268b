"""Launchers: one interface (base.Launcher), several implementations, by name in LAUNCHERS (docker and ecs import
lazily: naming one imports neither the Docker SDK nor boto3's ECS client)."""

from __future__ import annotations

from dispatcher.launchers.base import LaunchContext, Launcher, TaskHandle
from plumbing.registry import Registry

LAUNCHERS: Registry[type[Launcher]] = Registry("launcher", base=Launcher)
LAUNCHERS.register("process", "dispatcher.launchers.process:ProcessLauncher")
LAUNCHERS.register("docker", "dispatcher.launchers.docker:DockerLauncher")
LAUNCHERS.register("ecs", "dispatcher.launchers.ecs:EcsLauncher")


def launcher_class(spec) -> type[Launcher]:
    """The spec's launcher (backend.launcher: a registered name or a dotted path)."""
    return LAUNCHERS.get(spec.backend.launcher)


def problem(spec) -> str | None:
    """Why the spec's tasks cannot run on this host with its launcher (None when they can)."""
    return launcher_class(spec).problem(spec)


__all__ = ["LAUNCHERS", "LaunchContext", "Launcher", "TaskHandle", "launcher_class", "problem"]
