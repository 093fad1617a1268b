"""The trajectory policy: seeded agent call shapes (turns, reply sizes, the work asked between calls)."""

from __future__ import annotations

import re

from simulator.policy import Conversation, TrajectoryPolicy, TrajectoryShape

HEAD = re.compile(r"^TRAJECTORY (submit|think_s=([\d.]+) observe_chars=(\d+))$")


def replay(policy: TrajectoryPolicy, task: str) -> list[tuple[str, int]]:
    """Follow the policy's replies as an agent would, to its submit: (first line, output tokens) a turn."""
    turns: tuple[tuple[str, str], ...] = (("user", task),)
    out = []
    while True:
        reply = policy.reply(Conversation(turns=turns))
        head = reply.text.split("\n", 1)[0]
        out.append((head, reply.output_tokens))
        m = HEAD.match(head)
        assert m, head
        if m.group(1) == "submit":
            return out
        turns += (("assistant", reply.text), ("user", "x" * int(m.group(3))))


def test_trajectories_are_seeded_by_the_task_and_follow_the_shape():
    shape = TrajectoryShape()
    runs = {task: replay(TrajectoryPolicy(7), task) for task in (f"task {i}" for i in range(40))}
    assert replay(TrajectoryPolicy(7), "task 3") == runs["task 3"]  # the same attempt replays its trajectory
    assert replay(TrajectoryPolicy(8), "task 3") != runs["task 3"]  # another seed, another one
    lengths = [len(r) for r in runs.values()]
    assert min(lengths) >= shape.min_turns and max(lengths) <= shape.max_turns and len(set(lengths)) > 5
    outputs = sorted(tokens for r in runs.values() for _, tokens in r)
    median = outputs[len(outputs) // 2]
    assert 0.7 * shape.output_tokens <= median <= 1.3 * shape.output_tokens
    assert outputs[-1] > 2 * median  # a few long replies among many short ones
    thinks = sorted(float(HEAD.match(h).group(2)) for r in runs.values() for h, _ in r[:-1])
    assert 0.7 * shape.think_s <= thinks[len(thinks) // 2] <= 1.3 * shape.think_s
