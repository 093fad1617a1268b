"""Test environments for (repo, version): recipes, wheelhouses, and the process backend's own copies.

A recipe says how to build the conda env `testbed` an instance's eval script activates: which Python
(a version specifier), which packages (every one pinned), which extra wheels an offline
`pip install -e .` needs (`build`: the build backends), and the install step run in /testbed. Recipes
live in TOML files (`[[environment]]` tables, see docs/grading.md); a repository folder of git bundles
carries its own as `environments.toml` (examples/synthetic/repos/environments.toml).

The same recipe builds both places an eval script runs: the SWE-bench-shaped instance images
(eval_worker.images, with bullseye's Python) and the process backend's environments (ProcessEnvironment:
a venv from a host interpreter the specifier admits, never the worker's own, made once per recipe under
the state dir in the official conda layout, each grading working in a copy of its own). Both install from a
wheelhouse downloaded on the host, and both keep pip offline on it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eval_worker.shell import shell_lines

log = logging.getLogger("eval_worker.environments")

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = ROOT / "images" / "swebench"
CONDA_TEMPLATE = TEMPLATE_DIR / "conda"
TESTBED_ENV_SCRIPT = TEMPLATE_DIR / "testbed-env.sh"
RECIPES_FILE = "environments.toml"  # next to a folder's repository bundles
CONTAINER_CONDA_ROOT = "/opt/miniconda3"


def state_dir() -> Path:
    return Path(os.environ.get("EVALPLANE_STATE_DIR") or ROOT / ".state")


class GradingEnvironmentError(RuntimeError):
    """A recipe file is unusable, or an environment cannot be built: never a model failure."""


class EnvironmentRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    repo: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    versions: list[str] = Field(min_length=1)
    python: str  # a PEP 440 specifier the interpreter's version must satisfy, e.g. ">=3.9" or "==3.9.*"
    packages: list[str] = Field(min_length=1)  # installed into the env, each pinned with ==
    build: list[str] = Field(default_factory=list)  # only in the wheelhouse (build backends, each pinned)
    install: str = "python -m pip install -e ."  # run in /testbed with testbed active, once per checkout

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        try:
            SpecifierSet(v)
        except InvalidSpecifier as e:
            raise ValueError(f"not a version specifier: {v!r}") from e
        return v

    @field_validator("packages", "build")
    @classmethod
    def _pinned(cls, v: list[str]) -> list[str]:
        for item in v:
            try:
                req = Requirement(item)
            except InvalidRequirement as e:
                raise ValueError(f"{item!r}: {e}") from e
            if req.marker is not None or req.url or len(req.specifier) != 1 or next(
                    iter(req.specifier)).operator != "==":
                # the wheelhouse is downloaded with --no-deps for another Python: it must be the whole, exact set
                raise ValueError(f"{item!r}: pin every requirement exactly (name==version, no markers or URLs)")
        return v

    def admits(self, python_version: str) -> bool:
        return Version(python_version) in SpecifierSet(self.python)

    def requirements(self, drop: Iterable[str] = ()) -> list[str]:
        """The packages, without those named in drop (a deliberately broken environment)."""
        dropped = {d.lower() for d in drop}
        return [p for p in self.packages if Requirement(p).name.lower() not in dropped]

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class RecipeBook:
    """Recipes by (repo, version), from one or more TOML files (a later file never overrides an earlier one)."""

    def __init__(self, recipes: dict[tuple[str, str], EnvironmentRecipe] | None = None,
                 sources: list[str] | None = None):
        self.recipes = dict(recipes or {})
        self.sources = list(sources or [])

    @classmethod
    def load(cls, path: str | Path) -> RecipeBook:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise GradingEnvironmentError(f"{path}: {e}") from e
        unknown = set(data) - {"environment"}
        if unknown:
            raise GradingEnvironmentError(f"{path}: unknown top-level key(s) {sorted(unknown)}; expected [[environment]]")
        book = cls(sources=[str(path)])
        for i, entry in enumerate(data.get("environment", [])):
            try:
                recipe = EnvironmentRecipe.model_validate(entry)
            except ValidationError as e:
                problems = "; ".join(
                    f"environment[{i}].{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
                raise GradingEnvironmentError(f"{path}: {problems}") from None
            for v in recipe.versions:
                if (recipe.repo, v) in book.recipes:
                    raise GradingEnvironmentError(f"{path}: environment[{i}]: {recipe.repo} {v} has another recipe above")
                book.recipes[(recipe.repo, v)] = recipe
        return book

    def merged(self, other: RecipeBook) -> RecipeBook:
        return RecipeBook({**other.recipes, **self.recipes}, self.sources + other.sources)

    def get(self, repo: str, version: str) -> EnvironmentRecipe | None:
        return self.recipes.get((repo, str(version)))


def recipes_near(repo_source: str | Path) -> RecipeBook:
    """The recipes in the folder of a repository bundle (or beside a repository directory), if any."""
    f = Path(repo_source).parent / RECIPES_FILE
    return RecipeBook.load(f) if f.is_file() else RecipeBook()


# ------------------------------------------------------------------------------------- wheelhouse


def _lock(path: Path):
    """An exclusive flock on `path` (created if missing), released by closing the returned file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115  (the caller holds it: closing releases the lock)
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def wheelhouse(requirements: list[str], python_version: str, cache: Path | None = None) -> Path:
    """Wheels for exactly `requirements` (a complete pinned set) for CPython `python_version` (X.Y),
    downloaded once on the host (containers here cannot reach the package index) and cached."""
    major_minor = ".".join(python_version.split(".")[:2])
    key = hashlib.sha256(("\n".join(sorted(requirements)) + "\n" + major_minor).encode()).hexdigest()[:16]
    d = (cache or state_dir() / "wheels") / key
    if (d / ".complete").exists():
        return d
    with _lock(d.parent / f"{key}.lock"):
        if (d / ".complete").exists():
            return d
        shutil.rmtree(d, ignore_errors=True)
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d), "--only-binary=:all:",
             "--python-version", major_minor, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
             *requirements],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
        )
        if r.returncode != 0:
            shutil.rmtree(d, ignore_errors=True)
            raise GradingEnvironmentError(f"downloading wheels for Python {major_minor} failed: {r.stderr.strip()[-2000:]}")
        (d / ".complete").write_text("\n".join(requirements) + "\n")
    return d


# ------------------------------------------------------------------------------ process backend


_INSTALL_LINE = re.compile(
    r"^\s*(?:(?:python[\d.]*|\S*/python[\d.]*)\s+-m\s+)?(?:pip3?|uv\s+pip)\s+install\b"
    r"|\bsetup\.py\s+(?:develop|install)\b|^\s*conda\s+install\b|^\s*mamba\s+install\b"
)


def installs_packages(eval_script: str) -> list[str]:
    """The eval script's command lines (outside heredoc bodies) that install packages into the environment."""
    return [line.strip() for line in shell_lines(eval_script) if _INSTALL_LINE.search(line)]


@functools.cache
def probe_python(python: str) -> tuple[str, str] | None:
    """(X.Y.Z, the interpreter's own executable) of a Python that can make venvs, or None. The executable
    is the real one behind launchers such as pyenv's shims."""
    code = "import sys, os, venv, ensurepip; print('%d.%d.%d' % sys.version_info[:3]); print(os.path.realpath(sys.executable))"
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = r.stdout.split()
    return (lines[0], lines[1]) if r.returncode == 0 and len(lines) == 2 else None


def host_pythons(search_path: str | None = None) -> list[str]:
    """Interpreters on PATH (python3.N, python3), never the worker's own virtualenv."""
    worker_prefix = Path(sys.prefix).resolve()
    found = []
    for d in (search_path or os.environ.get("PATH", "")).split(os.pathsep):
        if not d or Path(d).resolve().is_relative_to(worker_prefix):
            continue
        for name in [f"python3.{n}" for n in range(30, 5, -1)] + ["python3"]:
            exe = Path(d) / name
            if exe.is_file() and os.access(exe, os.X_OK) and str(exe) not in found:
                found.append(str(exe))
    return found


def find_python(recipe: EnvironmentRecipe, candidates: list[str] | None = None) -> tuple[str, str]:
    """(interpreter, X.Y.Z): the newest candidate the recipe's specifier admits."""
    versions = {}
    for exe in candidates if candidates is not None else host_pythons():
        probed = probe_python(exe)
        if probed and probed[1] not in versions:
            versions[probed[1]] = probed[0]
    admitted = sorted(((Version(v), exe, v) for exe, v in versions.items() if recipe.admits(v)), reverse=True)
    if not admitted:
        have = ", ".join(f"{exe} ({v})" for exe, v in versions.items()) or "none"
        raise GradingEnvironmentError(f"no Python on this machine satisfies {recipe.repo}'s python {recipe.python!r} "
                                      f"(found: {have})")
    _, exe, v = admitted[0]
    return exe, v


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise GradingEnvironmentError(f"{venv}: no site-packages")
    return found[0]


def installed_set(venv: Path) -> list[str]:
    """The env's installed distributions (dist-info names), without editable installs (the instance's own
    repository, reinstalled by every grading): what must not change between gradings."""
    out = []
    for d in _site_packages(venv).glob("*.dist-info"):
        direct = d / "direct_url.json"
        try:
            if direct.is_file() and json.loads(direct.read_text()).get("dir_info", {}).get("editable"):
                continue
        except ValueError:
            pass
        out.append(d.name)
    return sorted(out)


@dataclass
class ProcessEnvironment:
    """One recipe's environment on this machine, in the official layout under `path`:
    miniconda3/{bin/activate, etc/profile.d/conda.sh, envs/testbed}, and the wheelhouse its pip uses."""

    recipe: EnvironmentRecipe
    path: Path
    python: str
    python_version: str
    wheels: Path

    @property
    def conda_root(self) -> Path:
        return self.path / "miniconda3"

    @property
    def venv(self) -> Path:
        return self.conda_root / "envs" / "testbed"

    @property
    def marker(self) -> Path:
        return self.path / ".complete"

    def checkout(self, dest: Path, owner: tuple[int, int]) -> None:
        """A private copy of the environment at `dest` for one grading (its `pip install -e .` changes it; the
        model's code runs in it): built or repaired first, under the environment's lock. Files are hard links to
        the built environment's, which stay root's and read-only to `owner`; folders are `owner`'s, so the grading
        can add, replace and remove files in its copy and never in the built environment."""
        with _lock(self.path.with_name(self.path.name + ".lock")):
            if not self.intact():
                self.build()
            shutil.copytree(self.path, dest, symlinks=True, copy_function=_link_or_copy)
        for d, _, _ in os.walk(dest):
            os.chown(d, *owner)

    def intact(self) -> bool:
        if not self.marker.is_file():
            return False
        try:
            return json.loads(self.marker.read_text())["installed"] == installed_set(self.venv)
        except (ValueError, KeyError, GradingEnvironmentError):
            return False

    def build(self) -> None:
        """(Re)build from the recipe; called with the lock held."""
        if self.marker.exists():
            log.warning("environment %s changed since it was built; rebuilding it", self.path)
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        shutil.copytree(CONDA_TEMPLATE, self.conda_root)
        r = subprocess.run(
            ["/bin/bash", str(TESTBED_ENV_SCRIPT), str(self.conda_root), self.python, str(self.wheels),
             *self.recipe.packages],
            env=isolated_pip_env(self.wheels), capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False,
        )
        if r.returncode != 0:
            raise GradingEnvironmentError(f"building the environment for {self.recipe.repo} in {self.path} failed: "
                                    f"{(r.stdout + r.stderr).strip()[-2000:]}")
        self.marker.write_text(json.dumps({
            "recipe": self.recipe.model_dump(), "python": self.python, "python_version": self.python_version,
            "installed": installed_set(self.venv)}, indent=1) + "\n")
        log.info("built environment %s (%s, Python %s)", self.path, self.recipe.repo, self.python_version)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def isolated_pip_env(wheels: Path) -> dict[str, str]:
    """Environment variables that make pip use only `wheels`, ignoring this machine's pip configuration."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


def template_digest() -> str:
    """The conda stand-in and the env script: part of every environment's identity."""
    h = hashlib.sha256()
    for f in sorted(p for p in CONDA_TEMPLATE.rglob("*") if p.is_file()) + [TESTBED_ENV_SCRIPT]:
        h.update(str(f.relative_to(TEMPLATE_DIR)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def process_environment(recipe: EnvironmentRecipe, *, root: Path | None = None,
                        pythons: list[str] | None = None) -> ProcessEnvironment:
    """The recipe's environment under <root> (default <state dir>/grading-envs), not yet built."""
    python, version = find_python(recipe, pythons)
    wheels = wheelhouse(recipe.packages + recipe.build, version)
    key = hashlib.sha256(f"{recipe.digest()}|{python}|{version}|{template_digest()}".encode()).hexdigest()[:12]
    name = f"{recipe.repo.replace('/', '__')}-py{'.'.join(version.split('.')[:2])}-{key}"
    return ProcessEnvironment(recipe, (root or state_dir() / "grading-envs") / name, python, version, wheels)
