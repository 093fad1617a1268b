"""Each harness end to end, unchanged, in its task image on the docker launcher, against the provider simulator
through the shim: one dispatcher run per harness (tests/harnesses/conftest.py) whose three instances cover the gold
patch resolving, the turn cap and the attempt cap each ending a session with the patch kept, all under 30% injected
429/529 that the harness never sees; and every connection its process tree attempted went to the shim."""

from __future__ import annotations

import pytest

from harness.adapters import ADAPTERS
from tests.harnesses.conftest import CASES, COST_CAP, GOLD, MAX_TURNS, TURN_CAP
from tests.harnesses.egress_trace import parse

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3000)]  # the first test of each harness builds its images and runs it


@pytest.fixture(scope="module", params=list(CASES))
def run(request, harness_runs):
    return harness_runs(request.param)


def test_the_gold_patch_comes_back_and_resolves(run):
    a = run.attempts[GOLD]
    assert (a["outcome"], a["status"]) == ("submitted", "RESOLVED"), (a, run.stderr[-2000:])
    assert a["patch_bytes"] > 0 and a["harness"] == run.harness


def test_every_call_is_metered_with_tokens(run):
    for iid, a in run.attempts.items():
        calls = run.calls[iid]
        assert len(calls) == a["calls"] >= 2, iid  # the attempt's totals agree with its ledger
        for c in calls:
            if c["outcome"] == "ok":
                assert c["input_tokens"] + c["cached_tokens"] + c["cache_write_tokens"] > 0 and c["output_tokens"] > 0
                assert c["cost_usd"] > 0 and c["model"] == run.case.model, c
        assert sum(c["input_tokens"] + c["cached_tokens"] + c["cache_write_tokens"] for c in calls) > 0


def test_the_turn_cap_ends_the_session_with_the_patch_kept(run):
    a = run.attempts[TURN_CAP]
    assert a["outcome"] == "max_turns_exceeded", a
    assert a["patch_bytes"] > 0 and a["status"] == "RESOLVED", a
    assert sum(c["outcome"] == "ok" for c in run.calls[TURN_CAP]) <= MAX_TURNS


def test_the_attempt_cap_ends_the_session_with_the_patch_kept(run):
    a = run.attempts[COST_CAP]
    assert a["outcome"] == "budget_exceeded", a
    assert a["patch_bytes"] > 0 and a["status"] == "RESOLVED", a
    # stopped by the cap, not the turn limit: fewer turns than the turn-cap instance was allowed
    assert sum(c["outcome"] == "ok" for c in run.calls[COST_CAP]) < MAX_TURNS


def test_injected_429_and_529_never_reach_the_harness(run):
    """The simulator failed about 30% of the upstream calls; the shim retried them, so every call the harness made
    was answered (no error status), and the outcomes above are those of a run without faults."""
    calls = [c for cs in run.calls.values() for c in cs]
    assert sum(c["retries"] for c in calls) >= 1
    answered = [c for c in calls if c["outcome"] == "ok"]
    assert all(c["http_status"] == 200 for c in answered)
    refused = [c for c in calls if c["outcome"] != "ok"]  # only the caps' refusals, at the end of their sessions
    seen = [(c["instance_id"], c["seq"], c["route"], c["stream"], c["http_status"], c["outcome"], c["retries"],
             round(c["latency_ms"])) for c in refused]
    assert {c["outcome"] for c in refused} <= {"max_turns_exceeded", "budget_exceeded"}, (seen, run.shim_complaints())
    assert {c["instance_id"] for c in refused} <= {TURN_CAP, COST_CAP}


def test_the_harness_calls_nobody_but_the_shim(run):
    adapter = ADAPTERS[run.harness]
    exe = (lambda argv0, argv: "mini_swe_agent_main" in " ".join(argv)) if not adapter.needs_image else (
        lambda argv0, argv: argv0.startswith(str(adapter.install_dir())))
    assert set(run.traces) == set(run.attempts), "a task container was not traced"
    for iid, path in run.traces.items():
        trace = parse(iid, path, exe)
        assert trace.harness_exec, f"{iid}: the harness started before the trace attached ({path})"
        assert trace.shim_ports, f"{iid}: the shim's port was not seen"
        to_shim = [d for d in trace.destinations if d not in trace.outside_shim]
        assert to_shim, f"{iid}: the harness never reached the shim?"
        assert trace.outside_shim == [], f"{iid}: connections outside the shim: {trace.outside_shim[:5]}"
