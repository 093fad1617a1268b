"""The test tiers, in one place: which tests need what (tests/conftest.py applies them at collection).

Every test gets exactly one tier marker:

  unit      needs no service at all: no PostgreSQL, Valkey, Docker, moto server, package index or other network.
            It may start its own processes on loopback (the simulator in a thread, `python -m simulator`); it
            passes in a network namespace of its own (scripts/test.sh --fast).
  services  the real PostgreSQL and Valkey, moto's server, LiteLLM, the package index; no Docker.
  docker    a Docker engine: images, containers.
  e2e       whole runs through every part (slow).

A test's tier is, first that wins:
  1. a tier marker the test carries itself (`@pytest.mark.docker`, `pytestmark = pytest.mark.e2e`), which must then
     be its only one (a test in an e2e module cannot mark itself unit: it moves to a file of its tier instead);
  2. the highest of its file's tier (FILES, else its folder's in FOLDERS, else unit) and the tiers of the fixtures it
     requests (FIXTURES: requesting `database_url` makes a test `services` wherever it lives).
So a folder mixes tiers without listing each test: a file needs an entry only where its tests need something no
fixture names (a pip download, a moto server it starts itself), or a test its own marker.

`unavailable(what, why)` is the one rule for a missing service: under CI=true the test fails, else it skips.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

import pytest

TIERS = ("unit", "services", "docker", "e2e")  # in order: a test takes the highest its needs reach (pyproject.toml
# registers them as markers)

# Paths relative to tests/. A folder's tier is the default for every file under it.
FOLDERS: dict[str, str] = {
    "e2e": "e2e",
}
FILES: dict[str, str] = {
    # grading on the process backend downloads the instance's wheels from the package index
    "eval_worker/test_grading.py": "services",
    "eval_worker/test_environments.py": "services",
    # starts the dispatcher's own moto server (dispatcher.backends.daemons)
    "dispatcher/test_localstack.py": "services",
    # its sandbox is a process-backend grading environment, built from the package index
    "security/test_grading_sandbox.py": "services",
}
# Fixtures that stand for a service (requested directly or through another fixture).
FIXTURES: dict[str, str] = {
    "database_url": "services",
    "valkey_url": "services",
    "moto_endpoint": "services",
    "iam_moto": "services",  # tests/infra/test_untrusted.py: a moto server with IAM enforcement
    "gateway": "services",  # tests/shim/test_shim_litellm.py: a LiteLLM proxy
    "gateway_tier": "services",  # tests/conftest.py: the gateway tier (LiteLLM replicas behind haproxy)
    "chromium": "services",  # tests/dashboard: headless Chromium from apt
    "docker_engine": "docker",  # tests/conftest.py: the engine and the base images
    "docker_client": "docker",  # tests/eval_worker: the engine and the base image
}

# e2e files whose runs use the process launcher and grader only: they need no Docker engine, so scripts/test.sh
# --side-by-side runs them in the services session (marked `no_docker`), beside the docker and e2e tiers' session. A
# test of theirs that requests a Docker fixture stays with the docker session.
E2E_WITHOUT_DOCKER = ("dispatcher/test_outage_run.py", "gateway/test_gateway_run.py", "dispatcher/test_lost_verdict.py",
                      "dashboard/test_demo_watched.py", "e2e/test_compute_cost.py", "e2e/test_custom_seams.py")
DOCKER_FIXTURES = frozenset(f for f, t in FIXTURES.items() if t == "docker")

_RANK = {t: i for i, t in enumerate(TIERS)}
TESTS = Path(__file__).resolve().parent


def path_tier(relpath: str) -> str:
    """The tier a file under tests/ gives its tests: its own entry, else its nearest folder's, else unit."""
    if relpath in FILES:
        return FILES[relpath]
    parents = PurePosixPath(relpath).parents
    for folder in parents:
        if str(folder) in FOLDERS:
            return FOLDERS[str(folder)]
    return "unit"


def tier_of(item: pytest.Item, relpath: str) -> str:
    own = {m.name for m in item.iter_markers() if m.name in _RANK}  # the test's, its class's, its module's
    if len(own) > 1:
        raise pytest.UsageError(f"{item.nodeid}: tier markers {sorted(own)}; a test has exactly one")
    if own:
        return own.pop()
    needs = [path_tier(relpath)] + [FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURES]
    return max(needs, key=_RANK.__getitem__)


# Folders whose files share session-scoped runs (tests/security: the red-team and honest runs): one group of tests
# each for pytest-xdist (tests/conftest.py's scheduler), so that one worker makes each run once. tests/harnesses makes
# one run per harness, which its tests share whichever file they are in: a group per harness.
SHARED_RUNS = ("security",)
PER_HARNESS = "harnesses"
# The heaviest groups, scheduled first so that no long group starts last (scripts/test.sh --workers).
HEAVY_FIRST = ("harnesses:openhands", "harnesses:aider", "security", "harnesses:claude-code", "harnesses:opencode",
               "harnesses:codex", "harnesses:mini-swe-agent", "e2e/test_local_run.py", "dispatcher/test_outage_run.py",
               "e2e/test_docker_run.py", "gateway/test_gateway_run.py", "dispatcher/test_lost_verdict.py")


def group_of(nodeid: str) -> str:
    """The group a test runs in under pytest-xdist's --dist loadgroup (its node id relative to tests/): its file,
    or its folder where the folder shares runs, or in tests/harnesses its harness (the test's parameter, or the
    file's own harness: test_aider.py). A group's tests stay on one worker, with the fixtures they share."""
    path, _, name = nodeid.partition("::")
    top = path.split("/", 1)[0]
    if top == PER_HARNESS:
        param = re.search(r"\[([\w.-]+)\]$", name)
        return f"{top}:{param.group(1) if param else PurePosixPath(path).stem.removeprefix('test_')}"
    return top if top in SHARED_RUNS else path


def mark(items: list[pytest.Item]) -> None:
    """Give each collected test its tier marker (tests/conftest.py's pytest_collection_modifyitems), and order
    the tests heaviest group first."""
    for item in items:
        path = item.path.relative_to(TESTS).as_posix()
        tier = tier_of(item, path)
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e" and path in E2E_WITHOUT_DOCKER and not DOCKER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.no_docker)
    rank = {g: i for i, g in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda it: rank.get(group_of(relative_id(it)), len(rank)))


def relative_id(item: pytest.Item) -> str:
    """The test's node id from tests/ on (`harnesses/test_harness_runs.py::test_x[aider]`)."""
    return item.path.relative_to(TESTS).as_posix() + "::" + item.nodeid.partition("::")[2]


def unavailable(what: str, why: str):
    """A service a test needs is missing: fail under CI=true (CI must run everything), skip with the reason otherwise."""
    msg = f"{what} unavailable: {why}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {msg}", pytrace=False)
    pytest.skip(msg)
