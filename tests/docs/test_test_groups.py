"""tests/tiers.py's grouping for pytest-xdist workers: what shares a run stays on one worker, what does not is free
to go to another."""

from __future__ import annotations

from tests.harnesses.conftest import CASES
from tests.tiers import HEAVY_FIRST, group_of


def test_each_harness_is_a_group_of_its_own_whatever_file_its_tests_are_in():
    assert group_of("harnesses/test_harness_runs.py::test_the_gold_patch_comes_back_and_resolves[aider]") == \
        group_of("harnesses/test_aider.py::test_aider_wrote_nothing_of_its_own") == "harnesses:aider"
    assert group_of("harnesses/test_openhands.py::test_x") == "harnesses:openhands"
    groups = {group_of(f"harnesses/test_harness_runs.py::test_x[{h}]") for h in CASES}
    assert len(groups) == len(CASES)  # one run per harness, each on the worker of its group
    assert groups <= set(HEAVY_FIRST)  # and every one scheduled among the heaviest


def test_a_folder_sharing_runs_is_one_group_and_other_tests_group_by_file():
    assert group_of("security/test_red_team.py::test_every_attack_ran") == \
        group_of("security/test_agent_view.py::test_the_agent_can_read_no_secret[docker]") == "security"
    assert group_of("e2e/test_local_run.py::test_cancel_stops_the_run_and_lands_every_attempt") == \
        "e2e/test_local_run.py"
