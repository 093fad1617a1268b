"""The shim as a child process of what meters calls through it (the task runner, the judge, the shim's tests and
bench): its config written only from a ShimConfig, the provider key in its environment and nowhere else."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from contract import task_shape
from plumbing.services import Service
from shim.config import UPSTREAM_KEY_ENV, ShimConfig

# any copy of a provider key in the parent's environment: none passes to the shim under another name
KEY_VARIABLES = (UPSTREAM_KEY_ENV, task_shape.UPSTREAM_KEY_ENV)


def shim_service(cfg: ShimConfig, config_file: Path, key: str | None, *, log: Path | None,
                 env: Mapping[str, str] | None = None, module: Sequence[str] = ("shim",), name: str = "the shim",
                 **service: object) -> Service:
    """A Service (not yet started) running `python -m shim` on cfg, written to config_file; ready once the shim
    has written cfg.port_file. key: the provider key, as $SHIM_UPSTREAM_KEY (None: none). env: the environment it
    starts from (this process's by default). module: what `python -m` runs (the task runner puts harness.sandbox
    in front, which makes the shim undumpable). name: what a start failure calls it. service: Service's other settings (timeout_s, grace_s, cwd...)."""
    if cfg.port_file is None:
        raise ValueError("the shim's config needs a port_file: it says when the shim is ready")
    config_file.write_text(cfg.model_dump_json())
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in KEY_VARIABLES}
    if key is not None:
        env[UPSTREAM_KEY_ENV] = key
    return Service([sys.executable, "-m", *module, "--config", str(config_file)], name=name, env=env, log=log,
                   ready_file=cfg.port_file, **service)  # type: ignore[arg-type]
