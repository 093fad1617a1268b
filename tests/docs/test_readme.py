"""The README's folder tables say what the tree holds: every folder they name exists, and every top-level folder of
the project and every package inside dispatcher/ is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = {".git", ".venv", ".state", ".ci", "__pycache__", ".pytest_cache", ".ruff_cache", "evalplane.egg-info"}


def named_paths() -> set[str]:
    """Every `path` in the first column of the README's tables."""
    names = set()
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            for name in re.findall(r"`([^`]+)`", first):
                names.add(name)
    return names


def test_every_folder_the_readme_names_exists():
    for name in named_paths():
        if "/" in name.rstrip("/") or name.endswith("/"):
            assert (ROOT / name).exists() or (ROOT / "dispatcher" / name).exists(), name


def test_every_top_level_folder_and_dispatcher_package_is_named():
    names = {n.rstrip("/") for n in named_paths()}
    short = {n.split("/")[-1] for n in names}
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in HIDDEN and not p.name.startswith(".")}
    assert top <= names, top - names
    packages = {p.name for p in (ROOT / "dispatcher").iterdir() if (p / "__init__.py").exists()}
    assert packages <= short, packages - short
