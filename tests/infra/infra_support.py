"""Pulumi mocks and the estate snapshot shared by the infra tests."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field

import pulumi
from pulumi.runtime.mocks import MockMonitor
from pulumi.runtime.settings import reset_options

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ACCOUNT = "123456789012"
REGION = "us-east-1"


@dataclass
class Recorded:
    typ: str
    name: str
    inputs: dict
    custom: bool
    id: str
    outputs: dict = field(default_factory=dict)
    urn: str = ""
    ignore_changes: list[str] = field(default_factory=list)


def _service(typ: str) -> str:
    return typ.split(":")[1].split("/")[0] if ":" in typ else "x"


class EstateMocks(pulumi.runtime.Mocks):
    """Echo inputs back and fabricate the computed outputs the program reads downstream."""

    def __init__(self) -> None:
        self.created: list[Recorded] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        typ, name, inputs = args.typ, args.name, dict(args.inputs)
        rid = f"{name}-id"
        out = dict(inputs)
        svc = _service(typ)
        phys = inputs.get("name") or f"{name}-phys"
        out.setdefault("name", phys)
        out.setdefault("arn", f"arn:aws:{svc}:{REGION}:{ACCOUNT}:{typ.split(':')[-1].lower()}/{phys}")
        out.setdefault("id", rid)
        if typ == "aws:kms/key:Key":
            out["keyId"] = f"{name}-keyid"
        elif typ == "aws:ec2/vpcEndpoint:VpcEndpoint":
            out["prefixListId"] = "pl-63a5400a"
        elif typ == "aws:rds/cluster:Cluster":
            out["endpoint"] = f"{name}.cluster-xyz.{REGION}.rds.amazonaws.com"
            out["masterUserSecrets"] = [
                {"secretArn": f"arn:aws:secretsmanager:{REGION}:{ACCOUNT}:secret:rds!cluster-{name}"}
            ]
        elif typ == "aws:elasticache/replicationGroup:ReplicationGroup":
            out["primaryEndpointAddress"] = f"master.{name}.cache.amazonaws.com"
        elif typ == "aws:s3/bucket:Bucket":
            out["bucket"] = f"{name}-bucket"
            out["arn"] = f"arn:aws:s3:::{name}-bucket"
            rid = out["id"] = f"{name}-bucket"
        elif typ == "aws:ecr/repository:Repository":
            out["repositoryUrl"] = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{phys}"
            out["arn"] = f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/{phys}"
        elif typ == "aws:lb/loadBalancer:LoadBalancer":
            out["dnsName"] = f"internal-{name}.{REGION}.elb.amazonaws.com"
        elif typ == "aws:ecs/taskDefinition:TaskDefinition":
            fam = inputs.get("family", name)
            out["arn"] = f"arn:aws:ecs:{REGION}:{ACCOUNT}:task-definition/{fam}:1"
            out["arnWithoutRevision"] = f"arn:aws:ecs:{REGION}:{ACCOUNT}:task-definition/{fam}"
        elif typ == "aws:ecs/cluster:Cluster":
            out["arn"] = f"arn:aws:ecs:{REGION}:{ACCOUNT}:cluster/{phys}"
        elif typ == "aws:iam/role:Role":
            out["arn"] = f"arn:aws:iam::{ACCOUNT}:role/{phys}"
        elif typ == "aws:autoscaling/group:Group":
            out["arn"] = f"arn:aws:autoscaling:{REGION}:{ACCOUNT}:autoScalingGroup:uuid:autoScalingGroupName/{phys}"
        elif typ == "aws:ec2/launchTemplate:LaunchTemplate":
            out["latestVersion"] = 1
        elif typ == "aws:cloudwatch/logGroup:LogGroup":
            out["arn"] = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{phys}"
        self.created.append(Recorded(typ, name, inputs, bool(args.custom), rid, out))
        return rid, out

    def call(self, args: pulumi.runtime.MockCallArgs):
        tok = args.token
        if tok == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": ACCOUNT, "arn": f"arn:aws:iam::{ACCOUNT}:user/test", "userId": "x", "id": ACCOUNT}
        if tok == "aws:index/getRegion:getRegion":
            return {"name": REGION, "region": REGION, "id": REGION, "endpoint": "", "description": ""}
        if tok == "aws:index/getAvailabilityZones:getAvailabilityZones":
            names = [f"{REGION}{c}" for c in "abcdef"]
            return {"names": names, "zoneIds": [f"use1-az{i}" for i in range(1, 7)], "id": REGION}
        if tok == "aws:secretsmanager/getRandomPassword:getRandomPassword":
            self.passwords = getattr(self, "passwords", 0) + 1
            return {"randomPassword": f"mockpassword{self.passwords:04d}{'x' * 24}", "id": f"pw{self.passwords}"}
        if tok == "aws:index/getPartition:getPartition":
            return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"}
        return {}

    # ---- queries used by the tests
    def custom(self) -> list[Recorded]:
        return [r for r in self.created if r.custom]

    def of(self, typ: str) -> list[Recorded]:
        return [r for r in self.created if r.typ == typ]

    def one(self, typ: str, name: str) -> Recorded:
        found = [r for r in self.created if r.typ == typ and r.name == name]
        assert len(found) == 1, (typ, name, [r.name for r in self.of(typ)])
        return found[0]


class RecordingMonitor(MockMonitor):
    """The mock monitor, also keeping each resource's ignore_changes (resource options the mocks are not shown)."""

    def __init__(self, mocks):
        super().__init__(mocks)
        self.ignored: dict[tuple[str, str], list[str]] = {}

    def RegisterResource(self, request):
        self.ignored[(request.type, request.name)] = list(request.ignoreChanges)
        return super().RegisterResource(request)


class MockRun:
    def __init__(self, mocks: EstateMocks, monitor: MockMonitor):
        self.mocks = mocks
        self.monitor = monitor

    def attach_urns(self) -> None:
        by_key = {}
        for urn in self.monitor.resources:
            qualified, name = urn.split("::")[2], urn.split("::")[3]
            by_key[(qualified.split("$")[-1], name)] = urn
        for r in self.mocks.created:
            r.urn = by_key.get((r.typ, r.name), "")
            r.ignore_changes = getattr(self.monitor, "ignored", {}).get((r.typ, r.name), [])


@dataclass
class Snapshot:
    """Everything one mocked `estate.build()` recorded, as plain data."""

    created: list[Recorded]
    outputs: dict

    def custom(self) -> list[Recorded]:
        return [r for r in self.created if r.custom]

    def of(self, typ: str) -> list[Recorded]:
        return [r for r in self.created if r.typ == typ]

    def one(self, typ: str, name: str) -> Recorded:
        found = [r for r in self.created if r.typ == typ and r.name == name]
        assert len(found) == 1, (typ, name, [r.name for r in self.of(typ)])
        return found[0]

    def by_id(self) -> dict[str, Recorded]:
        return {r.id: r for r in self.created if r.custom}


def build_snapshot(cfg=None) -> Snapshot:
    """Build the whole estate under fresh mocks on a fresh loop, then tear the runtime down again."""
    from components import estate
    from components.config import EstateConfig

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    mocks = EstateMocks()
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="evalplane", stack="test", preview=False, monitor=monitor)
    outputs: dict = {}
    try:

        @pulumi.runtime.test
        def build():
            out = estate.build(cfg or EstateConfig())
            return pulumi.Output.from_input(out).apply(outputs.update)

        build()
        MockRun(mocks, monitor).attach_urns()
    finally:
        reset_options()
        loop.close()
        asyncio.set_event_loop(None)
    return Snapshot(mocks.created, outputs)
