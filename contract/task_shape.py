"""What every agent task looks like wherever it runs (a task image on Docker or Fargate, or a local process).

One container: the task runner (`python -m harness <job-uri>`) starts the shim as its own child and then the
harness. The runtime (its own Python, the task runner, the shim, the harness) lives under RUNTIME_PREFIX, added as
a layer on top of the instance's own image, so nothing is installed into the instance's environment. The image
build (dispatcher.images), the launchers and the Pulumi HarnessFleet all read this one description.
"""

from __future__ import annotations

RUNTIME_PREFIX = "/opt/evalplane"
PYTHON = f"{RUNTIME_PREFIX}/bin/python3"
ENTRYPOINT = [PYTHON, "-m", "harness"]  # the job's URI is the one argument (the container command)
CONTAINER = "task"  # the task definition's one container; RunTask overrides its command
TESTBED = "/testbed"  # where the instance's repository is baked (and pruned at the base commit)
STATE_DIR = "/tmp/evalplane"  # the task's working files (shim config, ledger, trajectory)
UPSTREAM_KEY_ENV = "EVALPLANE_UPSTREAM_KEY"  # the run's upstream key: only the task runner reads it, only the shim gets it
OWN_CGROUP_ENV = "EVALPLANE_OWN_CGROUP"  # "1": the task is a container of its own, its cgroup its own (harness/usage.py)
# `dispatcher judge --api-key-env`'s default: locally the variable holding the judge's provider key; for a run on AWS
# the name of the gateway's provider key the judge's deployment uses (dispatcher/judge/ecs.py)
JUDGE_KEY_ENV = "EVALPLANE_JUDGE_KEY"
# A run's own secrets on AWS, {run_secrets_prefix}{run}/{name}: its gateway key (its tasks' execution role reads it) and
# its judge pass's gateway key (the judge task's role reads it)
RUN_KEY_SECRET = "gateway-key"
JUDGE_KEY_SECRET = "judge-key"
# The instance's own environment, as the official images and eval scripts activate it.
CONDA_ACTIVATE = "source /opt/miniconda3/bin/activate && conda activate testbed"
LABEL_PREFIX = "org.evalplane"
