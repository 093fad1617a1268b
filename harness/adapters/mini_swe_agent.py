"""mini-swe-agent (the real package), run in a child process against the shim with its SWE-bench config.

It is a Python package of the runtime's own interpreter (images/task/requirements.txt, pinned by requirements.lock),
so it also runs under the process launcher; its layer (images/task/harness/mini-swe-agent) only checks it is there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import Field

from contract.models import HarnessOutcome, Job
from harness.adapters.base import Cap, HarnessAdapter, HarnessRun, HarnessSettings

EXIT_STATUS = {
    "Submitted": HarnessOutcome.SUBMITTED,
    "LimitsExceeded": HarnessOutcome.MAX_TURNS_EXCEEDED,
    "TimeExceeded": HarnessOutcome.WALL_TIME_EXCEEDED,
}


class MiniSweAgentSettings(HarnessSettings):
    system_template: str | None = Field(None, description="replaces the SWE-bench config's system template")
    instance_template: str | None = Field(None, description="replaces the SWE-bench config's instance template")


class MiniSweAgent(HarnessAdapter):
    name = "mini-swe-agent"
    version = "2.4.6"
    Settings = MiniSweAgentSettings
    caps = frozenset({Cap.TURNS, Cap.WALL_TIME})  # step_limit, wall_time_limit_seconds; its cost_limit is off

    def prepare(self, job: Job, testbed: Path, workdir: Path, shim_url: str, local_token: str,
                env: dict[str, str]) -> HarnessRun:
        traj = workdir / "trajectory.json"
        settings = {
            "model_name": f"{job.model.provider}/{job.model.model}",
            "api_base": shim_url + ("/v1" if job.model.provider == "openai" else ""),
            "api_key": local_token,
            "cwd": str(testbed),
            "task": job.instance["problem_statement"],
            "step_limit": job.limits.max_turns or 0,
            "wall_time_s": int(job.limits.wall_time_s or 0),
            "trajectory": str(traj),
            "settings": self.settings.model_dump(exclude_none=True),
        }
        cfg = workdir / "harness.json"
        cfg.write_text(json.dumps(settings))
        home = workdir / "home"
        home.mkdir(exist_ok=True)
        env = env | {
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / ".config" / "mini-swe-agent"),
            "MSWEA_CONFIGURED": "true",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_COST_TRACKING": "ignore_errors",  # the shim meters and caps; mini's own estimate is not the record
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "3",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "HF_HUB_OFFLINE": "1",
        }
        return HarnessRun(argv=[sys.executable, "-m", "harness.adapters.mini_swe_agent_main", str(cfg)], env=env,
                          trajectory=traj)

    def outcome(self, run: HarnessRun, exit_code: int) -> HarnessOutcome:
        try:
            status = json.loads(run.trajectory.read_text())["info"]["exit_status"]
        except (OSError, ValueError, KeyError):
            return HarnessOutcome.HARNESS_ERROR
        return EXIT_STATUS.get(status, HarnessOutcome.HARNESS_ERROR)
