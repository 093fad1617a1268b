"""Entry point of the mini-swe-agent child process: its own SWE-bench config, a local environment, the shim."""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

import yaml


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    import litellm

    litellm.suppress_debug_info = True
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    base = yaml.safe_load(resources.files("minisweagent.config.benchmarks").joinpath("swebench.yaml").read_text())
    agent_cfg = base["agent"] | {
        "step_limit": cfg["step_limit"],
        "cost_limit": 0,  # caps are the shim's job
        "wall_time_limit_seconds": cfg["wall_time_s"],
        "output_path": Path(cfg["trajectory"]),
    }
    agent_cfg |= {k: v for k, v in cfg["settings"].items() if k in ("system_template", "instance_template")}
    env_cfg = base.get("environment", {})
    model = LitellmModel(
        model_name=cfg["model_name"],
        model_kwargs={"api_base": cfg["api_base"], "api_key": cfg["api_key"],
                      "max_tokens": cfg["settings"].get("max_tokens", 4096), "drop_params": True},
        cost_tracking="ignore_errors",
    )
    # BASH_ENV (the official config's /root/.bashrc) would activate the instance's conda env for every command: the
    # task runner already hands this process that environment, and outside an instance image it is the host's file
    cmd_env = {k: v for k, v in env_cfg.get("env", {}).items() if k != "BASH_ENV"}
    env = LocalEnvironment(cwd=cfg["cwd"], timeout=env_cfg.get("timeout", 60), env=cmd_env)
    agent = DefaultAgent(model, env, **agent_cfg)
    try:
        info = agent.run(task=cfg["task"])
    except Exception as e:  # noqa: BLE001 - the trajectory (saved on every step) records the exit; the task reads it
        print(f"mini-swe-agent ended with {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"mini-swe-agent exit status: {info.get('exit_status')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
