"""Aider's own checks on its end-to-end run (tests/harnesses/conftest.py; the checks every harness passes are in
test_harness_runs.py), plus its adapter and its simulator action format without containers.

Aider calls the model again only to reflect (on files it added to the chat, an edit that did not apply, lint
errors), at most three times a run. So its cap instances answer with the gold patch plus one hunk that cannot apply
(a model's stale hunk): Aider writes the hunks that apply, asks again, and the cap refuses that call, the gold patch
kept. The attempt-cap instance's stale hunk is long (its patch turn costs about $0.01), so the cost cap refuses the
call after it; the turn cap is three calls (Aider's fourth would be its last reflection anyway)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.models import HarnessOutcome
from harness.adapters import ADAPTERS
from harness.adapters.base import HarnessRun
from simulator.action_formats import choose
from simulator.action_formats.aider_udiff import ASK, STALE, file_sections
from simulator.policy import Conversation, DemoPolicy, PolicyFile
from tests.harnesses.conftest import ROWS, TURN_CAP
from tests.harnesses.test_seam import job

# the first test builds the images and runs the dispatcher: past pytest's default 600 s on a cold machine
pytestmark = pytest.mark.timeout(3000)


@pytest.fixture(scope="module")
def run(harness_runs):
    return harness_runs("aider")


@pytest.mark.e2e
def test_aider_wrote_nothing_of_its_own_and_its_trajectory_is_its_model_log(run):
    for iid, a in run.attempts.items():
        assert a["patch_bytes"] > 0, iid
        traj = run.trajectories[iid]
        assert traj["harness"] == "aider" and "SYSTEM" in traj["llm_history"], iid
    # look, the patch, the stale hunk again, then the refused fourth call; Aider retries an error it does not know
    # (LiteLLM's APIError for a 403) until the task runner, polling the shim, ends it: each retry is refused too
    cap = run.case.max_turns
    outcomes = [c["outcome"] for c in run.calls[TURN_CAP]]
    assert outcomes[:cap] == ["ok"] * cap and outcomes[cap:] and set(outcomes[cap:]) == {"max_turns_exceeded"}, outcomes


# ---------------------------------------------------------------------------------------------- without containers


def test_adapter_points_aider_at_the_shim_and_keeps_it_home(tmp_path):
    adapter = ADAPTERS["aider"]()
    r = adapter.prepare(job("aider", max_turns=3), Path("/testbed"), tmp_path, "http://127.0.0.1:9", "tok",
                        {"PATH": "/usr/bin"})
    assert r.argv[0] == "/opt/evalplane/harness/aider/bin/aider"
    assert r.env["OPENAI_API_BASE"] == "http://127.0.0.1:9/v1" and r.env["OPENAI_API_KEY"] == "tok"
    assert Path(r.env["HOME"]).is_relative_to(tmp_path) and r.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert not any("UPSTREAM" in k or k.startswith(("AWS_", "SHIM_")) for k in r.env)
    for flag in ("--yes-always", "--no-auto-commits", "--no-dirty-commits", "--no-gitignore", "--no-check-update",
                 "--analytics-disable", "--no-detect-urls", "--no-show-release-notes"):
        assert flag in r.argv, flag
    assert r.argv[r.argv.index("--edit-format") + 1] == "udiff" and r.argv[r.argv.index("--map-tokens") + 1] == "0"
    files = [r.argv[r.argv.index(f) + 1] for f in ("--message-file", "--model-metadata-file", "--llm-history-file",
                                                   "--chat-history-file", "--input-history-file")]
    assert all(Path(f).is_relative_to(tmp_path) for f in files)  # nothing of Aider's in /testbed
    assert "Fix the bug." in Path(files[0]).read_text()
    meta = json.loads(Path(files[1]).read_text())  # with the model's metadata it fetches none from the internet
    assert set(meta) == {"openai/m"} and meta["openai/m"]["max_input_tokens"] > 0
    anthropic = adapter.prepare(job("aider", "anthropic"), Path("/testbed"), tmp_path, "http://127.0.0.1:9", "tok", {})
    assert anthropic.env["ANTHROPIC_API_BASE"] == "http://127.0.0.1:9" and "OPENAI_API_BASE" not in anthropic.env
    assert adapter.outcome(r, 0) == HarnessOutcome.SUBMITTED and adapter.outcome(r, 1) == HarnessOutcome.HARNESS_ERROR
    adapter.collect(HarnessRun(r.argv, r.env, tmp_path / "t.json", extra=r.extra))
    assert json.loads((tmp_path / "t.json").read_text())["llm_history"] == ""


def aider_conversation(row: dict, replies: list[str]) -> Conversation:
    """Aider's request: its udiff system prompt, few-shot exchanges, the task, then each reply and its reflection."""
    turns = [("user", "Replace is_prime with a call to sympy."), ("assistant", "```diff\n--- a.py\n+++ a.py\n```"),
             ("user", "I switched to a new code base."), ("assistant", "Ok."), ("user", row["problem_statement"])]
    for text in replies:
        turns += [("assistant", text), ("user", "I added these files to the chat")]
    return Conversation(turns=tuple(turns), system="Return edits similar to unified diffs that `diff -U0` would produce.")


def test_format_asks_for_the_files_then_answers_with_udiff_blocks_then_text():
    row = ROWS[TURN_CAP]
    policy = DemoPolicy(PolicyFile.model_validate({"default": {"action": "gold"}}), list(ROWS.values()))
    first = aider_conversation(row, [])
    assert choose(first).name == "aider-udiff"
    look = policy.reply(first)
    assert look.call is None and look.text.startswith(ASK) and file_sections(row["patch"])[0][0] in look.text
    patch = policy.reply(aider_conversation(row, [look.text]))
    blocks = patch.text.split("```diff\n")[1:]
    assert len(blocks) == len(file_sections(row["patch"])) and all(b.startswith("--- a/") for b in blocks)
    hunks = "".join(ln for ln in row["patch"].splitlines(keepends=True) if ln.startswith(("+", "-", " ", "@@")))
    assert hunks.replace("\n", "") in patch.text.replace("\n", "").replace("```", "")
    done = policy.reply(aider_conversation(row, [look.text, patch.text]))
    assert done.call is None and "```" not in done.text  # a text answer: nothing more for Aider to apply
    going = DemoPolicy(PolicyFile.model_validate({"default": {"action": "gold", "keep_going": True}}), list(ROWS.values()))
    again = going.reply(aider_conversation(row, [look.text, patch.text]))
    assert STALE in again.text and "+" not in again.text.split("@@ @@")[1]  # a hunk that never applies, adds nothing


def test_format_reads_multi_file_and_new_file_patches():
    patch = ("diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n"
             "diff --git a/new.py b/new.py\nnew file mode 100644\nindex 0000000..e69de29\n--- /dev/null\n+++ b/new.py\n"
             "@@ -0,0 +1 @@\n+z\n")
    assert [p for p, _ in file_sections(patch)] == ["a.py", "new.py"]
    assert file_sections(patch)[1][1].startswith("--- /dev/null\n+++ b/new.py\n")
    from simulator.action_formats.aider_udiff import changed_files

    assert changed_files(patch) == ["a.py"]  # only files that exist can be added to Aider's chat
