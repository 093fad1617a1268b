"""The demo policy over HTTP: look, apply the patch in one bash tool call, submit; in both wire formats."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anthropic
import openai
import pytest
from minisweagent.models.utils.actions_toolcall import BASH_TOOL, parse_toolcall_actions

from simulator import SimulatorConfig
from simulator.policy import LOOK, SUBMIT, UNKNOWN_TEXT
from simulator.testing import running_simulator

STATEMENT = (
    "The add() helper subtracts instead of adding.\n\n  Steps to reproduce:   call add(2, 2). " + "x" * 400
)
OTHER = "Division by zero crashes the calculator when the divisor is 0. " * 8
EMPTY = "Please improve the documentation of this project, in a general way. " * 8
OVERRIDE = (
    "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return b + a\n"
)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    git(repo, "init", "-q")
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return repo


@pytest.fixture(scope="module")
def gold_patch(repo) -> str:
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    patch = git(repo, "diff")
    git(repo, "checkout", "-q", ".")
    return patch


@pytest.fixture(scope="module")
def url(tmp_path_factory, gold_patch):
    tmp = tmp_path_factory.mktemp("demo")
    rows = [
        {"instance_id": "calc-1", "problem_statement": STATEMENT, "patch": gold_patch},
        {"instance_id": "calc-2", "problem_statement": OTHER, "patch": gold_patch},
        {"instance_id": "calc-3", "problem_statement": EMPTY, "patch": gold_patch},
    ]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rules = {
        "default": {"action": "gold"},
        "instances": {"calc-2": {"action": "patch", "patch": OVERRIDE}, "calc-3": {"action": "empty"}},
    }
    (tmp / "policy.json").write_text(json.dumps(rules))
    with running_simulator(
        SimulatorConfig(policy=str(tmp / "policy.json"), dataset=tmp / "data.jsonl")
    ) as base:
        yield base


def task(statement: str) -> str:
    """A mini-swe-agent style task message: the statement inside a template, whitespace reflowed."""
    return f"Please solve this issue:\n<pr_description>\n{' '.join(statement.split())}\n</pr_description>"


def openai_turns(client, statement: str, turns: int) -> list:
    """Run `turns` assistant turns the way mini-swe-agent does, answering each tool call."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": task(statement)},
    ]
    answers = []
    for _ in range(turns):
        r = client.chat.completions.create(model="gpt-demo", messages=messages, tools=[BASH_TOOL])
        message = r.choices[0].message
        answers.append(r.choices[0])
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": "<returncode>0</returncode>"}
            )
    return answers


def commands(choices) -> list[str]:
    return [
        parse_toolcall_actions(c.message.tool_calls, format_error_template="{{error}}")[0]["command"]
        for c in choices
    ]


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)


def test_gold_script_applies_the_patch_then_submits(client, repo, gold_patch, tmp_path):
    choices = openai_turns(client, STATEMENT, 4)
    assert all(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 for c in choices)
    assert all(c.message.content.startswith("THOUGHT:") for c in choices)
    look, apply, submit, again = commands(choices)
    assert look == LOOK and submit == SUBMIT and again == SUBMIT
    assert gold_patch in apply and apply.startswith("git apply <<'EVALPLANE_PATCH'\n")

    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(repo), str(work)], check=True)
    subprocess.run(["bash", "-c", apply], cwd=work, check=True)
    assert (work / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    out = subprocess.run(["bash", "-c", submit], cwd=work, check=True, capture_output=True, text=True).stdout
    assert out.splitlines()[0] == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
    assert "+    return a + b" in out


def test_patch_override_and_empty_policy(client):
    assert OVERRIDE in commands(openai_turns(client, OTHER, 2))[1]
    assert commands(openai_turns(client, EMPTY, 2)) == [LOOK, SUBMIT]


def test_unknown_conversation_gets_plain_text(client):
    [choice] = openai_turns(client, "Something no dataset row mentions.", 1)
    assert choice.message.content == UNKNOWN_TEXT and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_streamed_tool_call_deltas_rebuild_the_command(client):
    messages = [{"role": "user", "content": task(STATEMENT)}, {"role": "assistant", "content": "looked"}]
    chunks = list(
        client.chat.completions.create(model="gpt-demo", messages=messages, tools=[BASH_TOOL], stream=True)
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "bash"
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments)["command"].startswith("git apply")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_route_with_content_blocks(url, gold_patch):
    client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
    user = {"role": "user", "content": [{"type": "text", "text": task(STATEMENT)}]}
    # mini-swe-agent's bash tool, as the messages route takes it (a request offering no tools gets text)
    bash = {"name": "bash", "input_schema": BASH_TOOL["function"]["parameters"]}
    first = client.messages.create(model="claude-demo", max_tokens=1000, messages=[user], tools=[bash])
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    tool = first.content[1]
    assert tool.name == "bash" and tool.input == {"command": LOOK} and tool.id.startswith("toolu_")
    history = [
        user,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "ok"}]},
    ]
    with client.messages.stream(model="claude-demo", max_tokens=1000, messages=history, tools=[bash]) as s:
        second = s.get_final_message()
    assert second.stop_reason == "tool_use" and gold_patch in second.content[1].input["command"]


# Codex CLI's shell tools: `exec_command` takes the command as a string, `shell` as an argv
EXEC_COMMAND = {"type": "function", "name": "exec_command", "description": "Run a command",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"},
                                                                "workdir": {"type": "string"}}, "required": ["cmd"]}}
SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                         "timeout_ms": {"type": "number"}}, "required": ["command"]}}
APPLY_PATCH = {"type": "function", "name": "apply_patch",
               "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}


def responses_turns(client, statement: str, turns: int, tools: list[dict]) -> list:
    """`turns` turns over the Responses API as Codex CLI makes them: the whole conversation as input items,
    each function call answered with a function_call_output."""
    items: list[dict] = [{"role": "user", "content": [{"type": "input_text", "text": task(statement)}]}]
    calls = []
    for _ in range(turns):
        r = client.responses.create(model="gpt-demo", instructions="You are Codex.", input=items, tools=tools)
        items += [o.model_dump(exclude_none=True) for o in r.output]
        for call in (o for o in r.output if o.type == "function_call"):
            calls.append(call)
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": "exit code 0"})
    return calls


def test_responses_api_replays_the_gold_patch_through_the_offered_tool(client, repo, gold_patch, tmp_path):
    calls = responses_turns(client, STATEMENT, 4, [APPLY_PATCH, SHELL, EXEC_COMMAND])
    assert [c.name for c in calls] == ["exec_command"] * 4 and all(c.call_id.startswith("call_") for c in calls)
    look, apply, submit, again = (json.loads(c.arguments)["cmd"] for c in calls)
    assert look == LOOK and submit == SUBMIT and again == SUBMIT and gold_patch in apply
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(repo), str(work)], check=True)
    subprocess.run(["bash", "-c", apply], cwd=work, check=True)
    assert (work / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    # an argv tool only: the command goes as bash -lc
    (first,) = responses_turns(client, STATEMENT, 1, [SHELL])
    assert first.name == "shell" and json.loads(first.arguments) == {"command": ["bash", "-lc", LOOK]}
    assert responses_turns(client, "Something no dataset row mentions.", 1, [EXEC_COMMAND]) == []


def test_responses_api_streams_the_function_call(client):
    items = [{"role": "user", "content": task(STATEMENT)},
             {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "calc.py"}]
    events = list(client.responses.create(model="gpt-demo", input=items, tools=[EXEC_COMMAND], stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [i.name for i in added] == ["exec_command"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments)["cmd"].startswith("git apply")  # the second turn applies the patch
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[-1].arguments == arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
