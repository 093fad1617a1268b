"""A red-team run (simulator/red_team.py) against an honest run that ends with the same tree, per launcher: every
attack fails or is flagged, and the rows, ledger, spend, verdict and Valkey keys of the two runs agree."""

from __future__ import annotations

import os
import pwd
from decimal import Decimal

import pytest

from eval_worker.sandbox import GRADER_USER
from simulator import red_team

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]  # the first test waits for two runs
IDS_AND_TIMINGS = {"run", "started_at", "ended_at", "eval_enqueued_at", "landed_at", "wall_time_s", "patch_uri",
                   "trajectory_uri", "report_uri"}
# what the agent's turns consumed: the red team's extra turns and longer observations cost more tokens; checked
# for consistency below (ledger = attempt totals = the run's spend in Valkey), not for equality
USAGE = {"calls", "input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens", "cost_usd"}
# what the task and its grading measured of the machine (CPU, memory, wall): the red team works longer, and these
# vary from run to run like timings; the resources the spec granted (task_cpu, task_memory_mib) must still agree
MEASURED = {"task_cpu_s", "task_memory_peak_bytes", "task_wall_s", "grading_wall_s", "grading_cpu_s", "compute_usd"}


def test_every_attack_ran(runs):
    red, _ = runs
    assert set(red["attacks"]) == set(red_team.ATTACKS), red["attacks"]


def test_the_runners_files_are_closed(runs):
    red, _ = runs
    files = red["attacks"]["shim"]["files"]
    assert any(p.endswith("/tasks") for p in files), files  # the runner's folder was tried ...
    assert all(v.startswith(("PermissionError", "FileNotFoundError")) for v in files.values()), files  # ... closed


def test_valkey_refuses_the_agent(runs):
    red, _ = runs
    tries = red["attacks"]["valkey"]["tries"]
    assert tries and not [k for k, v in tries.items() if v.startswith("SET")], tries


def test_no_address_but_the_shim_answers(runs):
    red, _ = runs
    tries = red["attacks"]["egress"]["tries"]
    for label, got in tries.items():
        if label.startswith("upstream") and got.startswith("HTTP"):
            assert got in ("HTTP 401", "HTTP 403"), (label, got)  # reachable on the process launcher: no key
        else:
            assert not got.startswith(("HTTP", "connected")), (label, got)


def test_no_later_history(runs):
    red, _ = runs
    h = red["attacks"]["history"]
    assert h["beyond_head"] == 0 and h["later_tags"] == [] and h["reflog"] == 0, h  # nothing past the base commit
    assert h["remotes"] == [] and not h["refs_changed_by_fetch"], h  # and nowhere to fetch it from
    assert not [r for r in h["refs"] if r.startswith("refs/remotes/")], h


def test_forged_messages_change_nothing_and_the_run_equals_the_honest_one(runs):
    red, honest = runs
    assert red["attacks"]["forge"]["tries"], red["attacks"]["forge"]
    a, b = red["attempt"], honest["attempt"]
    varies = IDS_AND_TIMINGS | USAGE | MEASURED
    same = {k: a[k] for k in a if k not in varies}
    assert same == {k: b[k] for k in b if k not in varies}
    assert red["patch"] == honest["patch"] and "conftest.py" in red["patch"]
    # the conftest.py that forces passes is left out of grading: the wrong fix's official verdict, in both runs
    assert a["status"] == "UNRESOLVED", a
    for k in ("resolved_ids", "unresolved_ids", "empty_patch_ids", "error_ids"):
        assert red["report"][k] == honest["report"][k], k
    assert [(p["phase"], p["outcome"]) for p in red["phases"]] == [(p["phase"], p["outcome"]) for p in honest["phases"]]
    # ledger: one row per model turn, each landed once; the red team's turns are its attacks more
    assert len(red["calls"]) == len(honest["calls"]) + len(red_team.ATTACKS)
    for r in (red, honest):
        ledger = sum((Decimal(str(c["cost_usd"])) for c in r["calls"]), Decimal(0))
        assert r["attempt"]["calls"] == len(r["calls"])
        assert Decimal(str(r["attempt"]["cost_usd"])) == ledger
        # the run's spend in Valkey, as the shims kept it: the agent's write of 0 never landed
        spent = int(r["budget"].get("spent", -1))  # micro-dollars, each call's rounded on its own
        assert abs(spent - ledger * 1_000_000) <= len(r["calls"]), (r["budget"], ledger)
        assert r["valkey_left"] == []  # the run's keys went with the run
        assert r["run_row"]["status"] == "finished"


def test_the_conftest_is_flagged(runs):
    red, honest = runs
    assert red["attacks"]["conftest"]["written"] is True
    if "tamper_flags" not in red["attempt"]:
        pytest.fail("attempts.tamper_flags is missing: the tamper flags (issue 24 item 4) are not merged")
    flags = red["attempt"]["tamper_flags"]
    assert {"rule": "conftest", "files": ["conftest.py"]} in flags, flags
    assert flags == honest["attempt"]["tamper_flags"]


CAP_SYS_ADMIN = 21


def test_grading_lets_the_models_code_reach_nothing_of_ours(runs):
    """The probe in the package's __init__.py ran inside grading (both runs carry it: it is in their common tree) and
    found no secret, no service, no way out but the package index (docker), and wrote nothing outside its sandbox."""
    for r in runs:
        probe, intel = r["probe"], r["grading"]
        assert probe is not None, "the grading probe did not run (no GRADING-PROBE line in the test output)"
        assert probe["canaries"] == [], probe["canaries"]
        verdict_key = intel["secrets"][0]
        assert probe["files"][verdict_key] != "read", probe["files"]
        assert {k: v for k, v in probe["connect"].items() if v == "connected"} == {}, probe["connect"]
        for folder in intel["write"]:  # on this host, nothing the probe wrote
            assert not os.path.exists(os.path.join(folder, intel["marker"])), (folder, probe["writes"])
        status = probe["status"]
        assert status["NoNewPrivs"] == "1" and not int(status["CapEff"], 16) & (1 << CAP_SYS_ADMIN), status
        if r["launcher"] == "process":
            grader = pwd.getpwnam(GRADER_USER)
            assert probe["uid"] == grader.pw_uid != 0 and probe["environ_read"] == [], probe
            assert len(probe["pids"]) <= 6, probe["pids"]  # its own PID namespace
            assert "index" not in probe  # no network at all
        else:
            assert probe["index"] == "HTTP 200", probe  # the package index, through the grading network's egress
