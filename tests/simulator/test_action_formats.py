"""The demo policy in each harness's action format, chosen from the request: the tool that applies the patch, the
finish step each harness expects, turns counted after the task message, text where no tools are offered."""

from __future__ import annotations

import pytest

from simulator.action_formats import FORMATS, choose
from simulator.policy import LOOK, SUBMIT, Conversation, DemoPolicy, OfferedTool, PolicyFile, normalise

STATEMENT = "The median of an even-length list is wrong: it returns the upper middle value. " * 5
ROW = {"instance_id": "calc-1", "problem_statement": STATEMENT, "patch": "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"}


def tool(name: str, *args: str, kind: str = "string") -> OfferedTool:
    return OfferedTool(name, {"type": "object", "properties": {a: {"type": kind} for a in args}})


TOOLSETS = {  # what each harness offers (names and argument keys, as they send them)
    "claude-code": (tool("Bash", "command", "description"), tool("Read", "file_path"),
                    tool("Edit", "file_path", "old_string", "new_string")),
    "codex": (tool("exec_command", "cmd", "workdir"), tool("write_stdin", "session_id", "chars"),
              tool("view_image", "path")),
    "opencode": (tool("bash", "command", "description"), tool("edit", "filePath", "oldString", "newString"),
                 tool("read", "filePath"), tool("todowrite", "todos", kind="array")),
    "shell-submit": (tool("bash", "command"),),  # mini-swe-agent
}
SHELL = {"claude-code": ("Bash", "command"), "codex": ("exec_command", "cmd"), "opencode": ("bash", "command"),
         "shell-submit": ("bash", "command")}


def conversation(tools, turns_after: int, before: tuple = ()) -> Conversation:
    turns = [*before, ("user", "Please fix this: " + STATEMENT)]
    for i in range(turns_after):
        turns += [("assistant", f"step {i}"), ("user", "tool output")]
    return Conversation(turns=tuple(turns), tools=tuple(tools))


def policy(**rules) -> DemoPolicy:
    return DemoPolicy(PolicyFile.model_validate({"default": {"action": "gold", **rules}}), [ROW])


@pytest.mark.parametrize("fmt", sorted(TOOLSETS))
def test_each_format_looks_patches_then_finishes_its_way(fmt):
    tools = TOOLSETS[fmt]
    assert choose(conversation(tools, 0)) is FORMATS[fmt]
    name, arg = SHELL[fmt]
    look, patch, done = (policy().reply(conversation(tools, n)) for n in (0, 1, 2))
    assert look.call.name == name and look.call.input == {arg: LOOK}
    assert patch.call.name == name and ROW["patch"].strip() in patch.call.input[arg]
    assert patch.call.input[arg].startswith("git apply <<'EVALPLANE_PATCH'")
    if fmt == "shell-submit":  # mini-swe-agent takes the submit command's output as its submission
        assert done.call.input == {arg: SUBMIT}
    else:  # a reply without a tool call ends these harnesses' loops (a submit command would be answered forever)
        assert done.call is None and done.text


def test_turns_count_after_the_task_message():
    """Few-shot exchanges before the task (Aider's, a system reminder) do not move the script."""
    before = (("user", "example question"), ("assistant", "example answer"), ("user", "another"), ("assistant", "x"))
    reply = policy().reply(conversation(TOOLSETS["claude-code"], 1, before))
    assert ROW["patch"].strip() in reply.call.input["command"]


def test_no_tools_gets_text_and_unknown_tasks_get_text():
    title = policy().reply(Conversation(turns=(("user", "Generate a title for: " + STATEMENT),)))
    assert title.call is None and "calc-1" in title.text  # opencode's title call
    other = policy().reply(Conversation(turns=(("user", "something else"),), tools=TOOLSETS["opencode"]))
    assert other.call is None


def test_keep_going_and_padding_after_the_patch():
    """For the caps: after the patch the script keeps looking (a cap ends it), each turn padded as asked."""
    p = policy(keep_going=True, pad_chars=4000)
    for n in (2, 5, 9):
        r = p.reply(conversation(TOOLSETS["codex"], n))
        assert r.call.input == {"cmd": LOOK} and len(r.text) > 4000 and r.output_tokens > 1000
    assert normalise(STATEMENT) in normalise(conversation((), 0).user_texts[0])


@pytest.mark.parametrize("fmt", sorted(TOOLSETS))
def test_a_scripted_command_runs_first_and_the_script_follows_one_turn_later(fmt):
    """For resources: an agent command of the policy's own (one allocating memory past the task's limit)."""
    tools = TOOLSETS[fmt]
    name, arg = SHELL[fmt]
    greedy = "python3 -c \"b = b'x' * (3 << 30)\""
    run, look, patch = (policy(command=greedy).reply(conversation(tools, n)) for n in (0, 1, 2))
    assert run.call.name == name and run.call.input == {arg: greedy}
    assert look.call.input == {arg: LOOK}
    assert ROW["patch"].strip() in patch.call.input[arg]
