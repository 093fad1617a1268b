"""The nightly guard's Lambda code, run against fake boto3 clients."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from components import guard_lambda as g

NOW = datetime(2026, 1, 2, 3, 0, tzinfo=UTC)


class FakeECS:
    def __init__(self, tasks):
        self.tasks, self.stopped, self.updated = tasks, [], []

    def get_paginator(self, name):
        assert name == "list_tasks"
        tasks = self.tasks

        class P:
            def paginate(self, cluster, desiredStatus):
                yield {"taskArns": [t["taskArn"] for t in tasks.get(cluster, [])]}

        return P()

    def describe_tasks(self, cluster, tasks, include):
        assert include == ["TAGS"] and len(tasks) <= 100
        return {"tasks": [t for t in self.tasks[cluster] if t["taskArn"] in tasks]}

    def stop_task(self, cluster, task, reason):
        self.stopped.append(task)

    def update_service(self, cluster, service, desiredCount):
        self.updated.append((cluster, service, desiredCount))


class FakeASG:
    def __init__(self):
        self.calls = []

    def update_auto_scaling_group(self, **kw):
        self.calls.append(kw)


class FakeEC2:
    def __init__(self):
        self.stopped = []

    def stop_instances(self, InstanceIds):
        self.stopped.extend(InstanceIds)


def _task(arn, deadline=None):
    return {"taskArn": arn, "tags": [{"key": "evalplane:deadline", "value": deadline}] if deadline else []}


def test_overdue_parses_the_deadline_tag():
    assert g.overdue(_task("a", "2026-01-02T02:59:00Z"), NOW, "evalplane:deadline")
    assert not g.overdue(_task("a", "2026-01-02T03:01:00+00:00"), NOW, "evalplane:deadline")
    assert not g.overdue(_task("a"), NOW, "evalplane:deadline")
    assert not g.overdue(_task("a", "not a date"), NOW, "evalplane:deadline")
    assert g.overdue(_task("a", "2026-01-01T00:00:00"), NOW, "evalplane:deadline")  # naive = UTC


def test_deadline_mode_stops_only_overdue_tasks(monkeypatch):
    ecs = FakeECS({"c1": [_task("t1", "2026-01-01T00:00:00Z"), _task("t2", "2027-01-01T00:00:00Z"), _task("t3")]})
    monkeypatch.setenv("CLUSTERS", "c1")
    monkeypatch.setenv("SERVICES", json.dumps([["c1", "svc"]]))
    monkeypatch.setenv("ASGS", "a1")
    out = g.handler({"mode": "deadline"}, None, clients={"ecs": ecs, "autoscaling": FakeASG(), "ec2": FakeEC2()}, now=NOW)
    assert out["stopped"] == ["t1"] and ecs.stopped == ["t1"] and ecs.updated == []


def test_nightly_mode_scales_every_tier_to_zero(monkeypatch):
    ecs, asg, ec2 = FakeECS({"c1": [_task("t1", "2026-01-01T00:00:00Z")]}), FakeASG(), FakeEC2()
    monkeypatch.setenv("CLUSTERS", "c1")
    monkeypatch.setenv("SERVICES", json.dumps([["gw", "evalplane-gateway"], ["ev", "evalplane-eval-worker"]]))
    monkeypatch.setenv("ASGS", "evalplane-eval,evalplane-build")
    monkeypatch.setenv("INSTANCES", "i-123")
    out = g.handler({"mode": "nightly"}, None, clients={"ecs": ecs, "autoscaling": asg, "ec2": ec2}, now=NOW)
    assert ecs.stopped == ["t1"]
    assert ecs.updated == [("gw", "evalplane-gateway", 0), ("ev", "evalplane-eval-worker", 0)]
    assert asg.calls == [
        {"AutoScalingGroupName": "evalplane-eval", "MinSize": 0, "DesiredCapacity": 0},
        {"AutoScalingGroupName": "evalplane-build", "MinSize": 0, "DesiredCapacity": 0},
    ]
    assert ec2.stopped == ["i-123"]
    assert out["scaled"] == {"services": 2, "asgs": 2, "instances": 1}


def test_the_deployed_code_is_this_module(estate_snapshot):
    (fn,) = estate_snapshot.of("aws:lambda/function:Function")
    assert fn.inputs["handler"] == "index.handler" and fn.inputs["runtime"].startswith("python3")
