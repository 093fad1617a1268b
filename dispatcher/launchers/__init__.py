"""Launchers: one interface, several backends (process now; docker and ecs later)."""

from dispatcher.launchers.base import Launcher, TaskHandle
from dispatcher.launchers.process import ProcessLauncher

__all__ = ["Launcher", "TaskHandle", "ProcessLauncher"]
