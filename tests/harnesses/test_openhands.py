"""OpenHands' own checks on its end-to-end run (tests/harnesses/conftest.py, in its task image with its own CPython
3.13; the checks every harness passes are in test_harness_runs.py), plus its adapter and its simulator action format
without containers. OpenHands caps its own turns (max_iteration_per_run = the attempt's max_turns), so the turn-cap instance
ends by its own MaxIterationsReached, before the shim would refuse a call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.models import HarnessOutcome
from harness.adapters import ADAPTERS
from harness.adapters.base import Cap
from simulator.action_formats import choose
from simulator.policy import LOOK, Conversation, DemoPolicy, OfferedTool, PolicyFile
from tests.harnesses.conftest import GOLD, MAX_TURNS, TURN_CAP
from tests.harnesses.test_seam import job

# the first test builds the images (its layer compiles a CPython) and runs the dispatcher: past pytest's default
# 600 s on a cold machine
pytestmark = pytest.mark.timeout(3000)


@pytest.fixture(scope="module")
def run(harness_runs):
    return harness_runs("openhands")


@pytest.mark.e2e
def test_openhands_ends_its_own_turns_and_its_trajectory_is_its_events(run):
    turn_cap = run.calls[TURN_CAP]
    assert len(turn_cap) == MAX_TURNS and all(c["outcome"] == "ok" for c in turn_cap)  # it stopped itself
    kinds = [e.get("kind") for e in run.trajectories[GOLD]["events"]]
    assert "ActionEvent" in kinds and "ObservationEvent" in kinds
    finish = [e for e in run.trajectories[GOLD]["events"] if e.get("kind") == "ActionEvent"][-1]
    assert finish["tool_name"] == "finish"
    errors = [e for e in run.trajectories[TURN_CAP]["events"] if e.get("kind") == "ConversationErrorEvent"]
    assert [e["code"] for e in errors] == ["MaxIterationsReached"]


# ---------------------------------------------------------------------------------------------- without containers


def test_adapter_points_openhands_at_the_shim(tmp_path):
    adapter = ADAPTERS["openhands"]()
    assert Cap.TURNS in adapter.caps
    r = adapter.prepare(job("openhands", max_turns=7), Path("/testbed"), tmp_path, "http://127.0.0.1:9", "tok",
                        {"PATH": "/usr/bin"})
    assert r.argv[0] == "/opt/evalplane/harness/openhands/bin/python3"
    assert r.argv[1] == "/opt/evalplane/harness/openhands/run_openhands.py" and r.argv[-1] == "7"
    assert "Fix the bug." in Path(r.argv[2]).read_text() and Path(r.argv[3]).is_relative_to(tmp_path)
    assert (r.env["LLM_MODEL"], r.env["LLM_BASE_URL"], r.env["LLM_API_KEY"]) == ("openai/m", "http://127.0.0.1:9/v1",
                                                                                 "tok")
    assert r.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and Path(r.env["HOME"]).is_relative_to(tmp_path)
    assert not any("UPSTREAM" in k or k.startswith(("AWS_", "SHIM_")) for k in r.env)
    status = Path(r.extra["status"])
    assert adapter.outcome(r, 0) == HarnessOutcome.HARNESS_ERROR  # no status written: it did not end properly
    for written, outcome in (({"execution_status": "finished", "error_codes": []}, HarnessOutcome.SUBMITTED),
                             ({"execution_status": "error", "error_codes": ["MaxIterationsReached"]},
                              HarnessOutcome.MAX_TURNS_EXCEEDED),
                             ({"execution_status": "stuck", "error_codes": []}, HarnessOutcome.HARNESS_ERROR)):
        status.write_text(json.dumps(written))
        assert adapter.outcome(r, 0) == outcome


def openhands_tools() -> tuple[OfferedTool, ...]:
    """What OpenHands offers (names and argument schemas, as its requests carry them)."""
    risk = {"type": "string", "enum": ["UNKNOWN", "LOW", "MEDIUM", "HIGH"]}
    return (OfferedTool("terminal", {"type": "object", "required": ["command", "security_risk"], "properties": {
                "command": {"type": "string"}, "security_risk": risk, "summary": {"type": "string"}}}),
            OfferedTool("file_editor", {"type": "object", "properties": {"command": {"type": "string"},
                                                                           "path": {"type": "string"}}}),
            OfferedTool("finish", {"type": "object", "properties": {"message": {"type": "string"}}}),
            OfferedTool("think", {"type": "object", "properties": {"thought": {"type": "string"}}}))


def test_format_uses_the_terminal_with_a_risk_level_then_finishes():
    row = {"instance_id": "x-1", "problem_statement": "The parser drops the last token of every line. " * 8,
           "patch": "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n"}

    def conv(n: int) -> Conversation:
        turns = [("user", row["problem_statement"])]
        for i in range(n):
            turns += [("assistant", f"step {i}"), ("user", "output")]
        return Conversation(turns=tuple(turns), tools=openhands_tools())

    assert choose(conv(0)).name == "openhands-terminal"
    gold = DemoPolicy(PolicyFile.model_validate({"default": {"action": "gold"}}), [row])
    look, patch, done = (gold.reply(conv(n)) for n in (0, 1, 2))
    assert look.call.name == "terminal" and look.call.input["command"] == LOOK
    assert look.call.input["security_risk"] == "LOW" and look.call.input["summary"]
    assert patch.call.name == "terminal" and "+y" in patch.call.input["command"]
    assert done.call.name == "finish" and done.call.input["message"]
    going = DemoPolicy(PolicyFile.model_validate({"default": {"action": "gold", "keep_going": True}}), [row])
    later = [going.reply(conv(n)).call.input["command"] for n in (2, 3, 4, 5)]
    assert len(set(later)) == 4 and all(c.startswith(LOOK) for c in later)  # never four identical actions
