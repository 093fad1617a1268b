"""The harness seam: one adapter per harness turns (job, checkout, shim endpoint) into a process to run, and reads
how it ended. Adding a harness is one module and one layer; nothing else in the project names a harness.

Layout (a harness called NAME, module harness/adapters/NAME_WITH_UNDERSCORES.py):

* The adapter: a subclass of HarnessAdapter, registered in harness/adapters/__init__.py's ADAPTERS under NAME (a
  spec may also name "package.module:Class", loaded by `load_adapter`). It declares:
    - `version`: the harness's version, pinned (the layer installs exactly this one);
    - `Settings`: a pydantic model (subclass of HarnessSettings, extra fields forbidden) for the spec's
      `[harness] settings`; dispatcher/spec.py validates the spec against it, errors name the field
      (`harness.settings.FIELD`); the task reads `self.settings` (max_tokens is filled from model.max_tokens);
    - `caps`: which of the attempt's caps (Cap.TURNS, Cap.COST, Cap.WALL_TIME) it is told and enforces itself;
      the shim enforces every cap anyway (budget_exceeded / max_turns_exceeded end the session, the wall-time
      guard in harness/task.py ends the process group), this only says what the harness also knows;
    - `providers`: the model providers ("openai": chat completions or Responses; "anthropic": messages) it can
      speak to the shim in; the spec is refused for any other;
    - `needs_image`: True when the harness is installed only in its image layer (npm binaries): the spec then
      needs task images (the docker launcher, chosen automatically when `backend.launcher` is unset, or aws);
    - `scratch`: files it writes in the repository that are never part of the patch;
    - `prepare(job, testbed, workdir, shim_url, local_token, env) -> HarnessRun`: writes its config files under
      `workdir` (never into /testbed), and returns argv, the COMPLETE environment (start from `env`, the
      instance's own environment without secrets; add the shim's URL and the task's local token, never the
      provider key; turn off telemetry, update checks, anything that calls home), the task text on stdin if it
      takes it that way, and where its stdout goes;
    - `outcome(run, exit_code) -> HarnessOutcome`: how the harness says it ended (the shim's stop reason and
      the wall-time guard take precedence; the task runner asks only when neither fired);
    - `collect(run)`: leaves the trajectory at `run.trajectory` (JSON; the task runner uploads it), from
      whatever the harness wrote (its stdout events, its session files). The patch is always
      `git diff` of /testbed against the base commit (harness/task.py take_patch), minus `scratch`.
* The layer: images/task/harness/NAME/Dockerfile, built `FROM ${RUNTIME_IMAGE}` (the runtime's packages: its
  own Python and what the task runner and the shim import, never the project's code, so that a change to the code
  does not rebuild the layer; images/task/Dockerfile.runtime) with `ARG PREFIX`, installing ONLY under
  ${PREFIX}/harness/NAME (`install_dir()`). Containers reach no package registry: whatever the layer needs is
  fetched on the host by `prepare_layer(ctx)` into the build context (npm: `npm install --prefix ctx/npm`, with
  the machine's npm config; Python: `pip download` wheels, as dispatcher/images.py does for the runtime; PipHarness does it) and
  COPYed in. `layer_inputs()` hashes the version, the layer folder and anything else the layer is made of:
  dispatcher/images.py keys the layer image and every task image (table task_images) by it, so a harness whose
  inputs did not change is never rebuilt.
* The task image: FROM the instance image; COPY of the runtime's packages (one layer, shared by every harness);
  COPY of ${PREFIX}/harness/NAME from the harness layer; COPY of the project's code (${PREFIX}/app); /testbed
  pruned (dispatcher/images.py).
* The simulator: the harness's action format, one module under simulator/action_formats/ (registry FORMATS in
  its __init__): which requests it recognises (tool names and argument keys offered, or the system prompt), the
  tool call that applies the patch, the finish step the harness expects.
* The README's harness table: one row (what it caps itself, version, the command to run the demo with it), and
  examples/harnesses/NAME.toml.
* Tests: tests/harnesses/test_NAME.py (tests/harnesses/conftest.py runs one spec per harness through the
  dispatcher with the docker launcher, and checks the four cases: resolved, turn cap, attempt cap, injected
  429/529).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from contract import task_shape
from contract.models import HarnessOutcome, Job

ROOT = Path(__file__).resolve().parents[2]  # the project (or the runtime's app folder, inside a task image)
LAYERS = ROOT / "images" / "task" / "harness"


class Cap(StrEnum):
    TURNS = "turns"
    COST = "cost"
    WALL_TIME = "wall_time"


class HarnessSettings(BaseModel):
    """The spec's `[harness] settings` for one harness: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = Field(None, ge=1, description="the most output tokens per call (default: model.max_tokens)")


@dataclass
class HarnessRun:
    argv: list[str]
    env: dict[str, str]  # the COMPLETE environment of the harness process: no secrets in it
    trajectory: Path  # where the trajectory is once collect() ran (JSON)
    stdin: Path | None = None  # a file fed to the harness on stdin (the task text), else /dev/null
    stdout: Path | None = None  # where its stdout goes, apart from stderr (harness.log); None: both to harness.log
    extra: dict[str, str] = field(default_factory=dict)  # adapter-specific paths (session dirs, config files)


class HarnessAdapter:
    """One harness. Subclasses set the class attributes and implement prepare and outcome (see the module doc)."""

    name: ClassVar[str]
    version: ClassVar[str]
    Settings: ClassVar[type[HarnessSettings]] = HarnessSettings
    caps: ClassVar[frozenset[Cap]] = frozenset()
    providers: ClassVar[tuple[str, ...]] = ("openai", "anthropic")
    needs_image: ClassVar[bool] = False
    scratch: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: dict | None = None):
        self.settings = self.Settings.model_validate(settings or {})

    # ------------------------------------------------------------------ the layer
    @classmethod
    def layer_dir(cls) -> Path:
        return LAYERS / cls.name

    @classmethod
    def install_dir(cls) -> Path:
        """Where the layer installs the harness, inside the task image."""
        return Path(task_shape.RUNTIME_PREFIX) / "harness" / cls.name

    @classmethod
    def layer_inputs(cls) -> str:
        """Everything the layer is made of, hashed (its version and its folder's files)."""
        h = hashlib.sha256(json.dumps([cls.name, cls.version]).encode())
        for f in sorted(p for p in cls.layer_dir().rglob("*") if p.is_file()):
            h.update(str(f.relative_to(cls.layer_dir())).encode() + b"\0" + f.read_bytes() + b"\0")
        return h.hexdigest()

    @classmethod
    def prepare_layer(cls, ctx: Path) -> None:
        """Fill the layer's build context `ctx` (which already holds the layer folder's files) with what is fetched
        on the host. Nothing by default."""

    # ------------------------------------------------------------------ a run
    def prompt(self, job: Job, testbed: Path) -> str:
        """The task text for harnesses that take the issue as it is (those with their own template override)."""
        return (f"{job.instance['problem_statement'].strip()}\n\n"
                f"The repository is checked out in {testbed}, your working directory. Fix the issue above by "
                "changing the source files there; do not commit.")

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        raise NotImplementedError

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        raise NotImplementedError

    def collect(self, run: HarnessRun) -> None:
        """Leave the trajectory at run.trajectory. Default: the harness wrote it there itself, or its stdout events
        (JSON lines) are the trajectory."""
        if run.trajectory.exists() or run.stdout is None or not run.stdout.exists():
            return
        run.trajectory.write_text(json.dumps({"harness": self.name, "version": self.version,
                                              "events": read_json_lines(run.stdout)}))


def read_json_lines(path: Path) -> list:
    """The JSON values of a JSON-lines file; a line that is not JSON is kept as text."""
    out: list = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append(line)
    return out


def shim_base(shim_url: str, provider: str) -> str:
    """The shim's base URL as OpenAI-style clients want it (…/v1) or Anthropic-style ones (the root)."""
    return shim_url + "/v1" if provider == "openai" else shim_url


class NpmHarness(HarnessAdapter):
    """A harness shipped on npm as a native binary (node is not needed to run it). The host installs the pinned
    package with its own npm configuration (containers reach no registry) into a cache under .state/npm, and the
    layer gets only the files `binaries` names (destination under the layer's bin/ -> path under node_modules)."""

    npm_package: ClassVar[str]
    binaries: ClassVar[dict[str, str]]
    needs_image = True

    @classmethod
    def layer_inputs(cls) -> str:
        return hashlib.sha256((super().layer_inputs() + json.dumps([cls.npm_package, cls.binaries])).encode()).hexdigest()

    @classmethod
    def npm_install(cls) -> Path:
        """The package installed on the host (once per version): its node_modules folder."""
        import os
        import shutil
        import subprocess

        state = Path(os.environ.get("EVALPLANE_STATE_DIR", ROOT / ".state"))
        cache = state / "npm" / f"{cls.name}-{cls.version}"
        if not (cache / ".complete").exists():
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
            npm = shutil.which("npm")
            if npm is None:
                raise RuntimeError(f"the {cls.name} layer needs npm on the host (apt-get install npm)")
            p = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(cache),
                                f"{cls.npm_package}@{cls.version}"], capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, check=False)
            if p.returncode != 0:
                raise RuntimeError(f"npm install {cls.npm_package}@{cls.version} failed: {p.stderr[-2000:]}")
            (cache / ".complete").touch()
        return cache / "node_modules"

    @classmethod
    def prepare_layer(cls, ctx: Path) -> None:
        import shutil

        modules = cls.npm_install()
        (ctx / "bin").mkdir(exist_ok=True)
        for dest, src in cls.binaries.items():
            if not (modules / src).is_file():
                raise RuntimeError(f"{cls.npm_package}@{cls.version} has no {src} (its platform package is missing)")
            shutil.copy2(modules / src, ctx / "bin" / dest)

    @classmethod
    def executable(cls, name: str | None = None) -> str:
        return str(cls.install_dir() / "bin" / (name or next(iter(cls.binaries))))


class PipHarness(HarnessAdapter):
    """A harness shipped on PyPI, for a Python other than (or pinned apart from) the runtime's own packages. Its layer
    folder holds requirements.txt and constraints.txt (the pinned dependency closure); the host downloads their wheels
    for `python` (containers reach no registry) into a cache under .state/wheels, once per inputs, and the layer
    installs them with --no-index. Packages published only as source (`sdists`, pure Python) are built into wheels on
    the host first. The layer's context also gets images/task/collect_libs.sh, for layers that build an interpreter."""

    python: ClassVar[str]  # the version of the interpreter the layer runs it on (wheel tags are chosen for it)
    sdists: ClassVar[tuple[str, ...]] = ()
    needs_image = True

    @classmethod
    def layer_inputs(cls) -> str:
        return hashlib.sha256((super().layer_inputs() + json.dumps([cls.python, cls.sdists])).encode()).hexdigest()

    @classmethod
    def wheels(cls) -> Path:
        """The layer's wheels, downloaded on the host (once per inputs): a folder of .whl files."""
        import os
        import shutil
        import subprocess
        import sys

        state = Path(os.environ.get("EVALPLANE_STATE_DIR", ROOT / ".state"))
        cache = state / "wheels" / f"{cls.name}-{cls.layer_inputs()[:16]}"
        if (cache / ".complete").exists():
            return cache
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        req, pins = cls.layer_dir() / "requirements.txt", cls.layer_dir() / "constraints.txt"
        pip = [sys.executable, "-m", "pip"]
        steps = [[*pip, "wheel", "-q", "--no-deps", "--no-binary", ":all:", "-c", str(pins), "-w", str(cache), *cls.sdists]
                 ] if cls.sdists else []
        plat = [a for p in ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "linux_x86_64",
                            "any") for a in ("--platform", p)]
        steps.append([*pip, "download", "-q", "--only-binary=:all:", "--python-version", cls.python, *plat,
                      "--find-links", str(cache), "-c", str(pins), "-r", str(req), "pip", "-d", str(cache)])
        for argv in steps:
            p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(argv[2:4])} for the {cls.name} layer failed: {p.stderr[-2000:]}")
        (cache / ".complete").touch()
        return cache

    @classmethod
    def prepare_layer(cls, ctx: Path) -> None:
        import shutil

        shutil.copytree(cls.wheels(), ctx / "wheels", ignore=shutil.ignore_patterns(".complete"))
        shutil.copy(ROOT / "images" / "task" / "collect_libs.sh", ctx / "collect_libs.sh")


def harness_home(workdir: Path) -> Path:
    """A home of its own for the harness (its settings, caches, sessions): never the container's /root."""
    home = workdir / "home"
    (home / ".config").mkdir(parents=True, exist_ok=True)
    return home


def write_task(job: Job, adapter: HarnessAdapter, testbed: Path, workdir: Path) -> Path:
    task = workdir / "task.txt"
    task.write_text(adapter.prompt(job, testbed))
    return task
