"""Launchers: one interface, several backends (process, docker, ecs). docker and ecs import lazily."""

from dispatcher.launchers.base import Launcher, TaskHandle
from dispatcher.launchers.process import ProcessLauncher

__all__ = ["Launcher", "ProcessLauncher", "TaskHandle"]
