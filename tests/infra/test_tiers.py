"""The tiers' repeated blocks come from components/tiers.py, keep their URNs, and keep one shape everywhere."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What tiers.py declares, and where else it may still be declared directly.
HELPER_MADE = {
    "aws.ecs.Cluster": set(),
    "aws.cloudwatch.LogGroup": set(),
    "aws.ecs.TaskDefinition": set(),
    "aws.ecs.Service": {"eval_fleet.py"},  # the eval workers: EC2 tasks on the fleet's capacity provider, no ALB
    "aws.lb.LoadBalancer": set(),
    "aws.lb.TargetGroup": set(),
    "aws.lb.Listener": set(),
    "aws.lb.ListenerRule": set(),
    "aws.autoscaling.Group": set(),
    "aws.ecs.CapacityProvider": set(),
}

# The URNs (parent type, resource type, name) of those blocks: the helpers must not move one.
URNS_TEXT = """
evalplane:build:BuildTier$aws:autoscaling/group:Group::evalplane-build-asg
evalplane:eval:EvalFleet$aws:autoscaling/group:Group::evalplane-eval-asg
evalplane:eval:EvalFleet$aws:cloudwatch/logGroup:LogGroup::evalplane-eval-logs
evalplane:gateway:Gateway$aws:cloudwatch/logGroup:LogGroup::evalplane-gateway-logs
evalplane:guard:NightlyGuard$aws:cloudwatch/logGroup:LogGroup::evalplane-guard-logs
evalplane:harness:HarnessFleet$aws:cloudwatch/logGroup:LogGroup::evalplane-harness-logs
evalplane:head:HeadNode$aws:cloudwatch/logGroup:LogGroup::evalplane-head-logs
evalplane:judge:Judge$aws:cloudwatch/logGroup:LogGroup::evalplane-judge-logs
evalplane:eval:PackageIndex$aws:cloudwatch/logGroup:LogGroup::evalplane-pkg-index-logs
evalplane:build:BuildTier$aws:ec2/launchTemplate:LaunchTemplate::evalplane-build-lt
evalplane:eval:EvalFleet$aws:ec2/launchTemplate:LaunchTemplate::evalplane-eval-lt
evalplane:head:HeadNode$aws:ec2/launchTemplate:LaunchTemplate::evalplane-head-lt
evalplane:eval:EvalFleet$aws:ecs/capacityProvider:CapacityProvider::evalplane-eval-cp
evalplane:eval:EvalFleet$aws:ecs/cluster:Cluster::evalplane-eval-cluster
evalplane:gateway:Gateway$aws:ecs/cluster:Cluster::evalplane-gateway-cluster
evalplane:harness:HarnessFleet$aws:ecs/cluster:Cluster::evalplane-harness-cluster
evalplane:eval:PackageIndex$aws:ecs/cluster:Cluster::evalplane-pkg-index-cluster
evalplane:eval:EvalFleet$aws:ecs/clusterCapacityProviders:ClusterCapacityProviders::evalplane-eval-capacity
evalplane:harness:HarnessFleet$aws:ecs/clusterCapacityProviders:ClusterCapacityProviders::evalplane-harness-capacity
evalplane:eval:EvalFleet$aws:ecs/service:Service::evalplane-eval-service
evalplane:gateway:Gateway$aws:ecs/service:Service::evalplane-gateway-service
evalplane:eval:PackageIndex$aws:ecs/service:Service::evalplane-pkg-index-service
evalplane:eval:EvalFleet$aws:ecs/taskDefinition:TaskDefinition::evalplane-eval-task
evalplane:gateway:Gateway$aws:ecs/taskDefinition:TaskDefinition::evalplane-gateway-task
evalplane:harness:HarnessFleet$aws:ecs/taskDefinition:TaskDefinition::evalplane-harness-task
evalplane:judge:Judge$aws:ecs/taskDefinition:TaskDefinition::evalplane-judge-task
evalplane:eval:PackageIndex$aws:ecs/taskDefinition:TaskDefinition::evalplane-pkg-index-task
evalplane:build:BuildTier$aws:iam/instanceProfile:InstanceProfile::evalplane-build-profile
evalplane:eval:EvalFleet$aws:iam/instanceProfile:InstanceProfile::evalplane-eval-instance-profile
evalplane:head:HeadNode$aws:iam/instanceProfile:InstanceProfile::evalplane-head-profile
evalplane:gateway:Gateway$aws:lb/listener:Listener::evalplane-gateway-listener
evalplane:eval:PackageIndex$aws:lb/listener:Listener::evalplane-pkg-index-listener
evalplane:eval:PackageIndex$aws:lb/listenerRule:ListenerRule::evalplane-pkg-index-read
evalplane:gateway:Gateway$aws:lb/loadBalancer:LoadBalancer::evalplane-gateway-alb
evalplane:eval:PackageIndex$aws:lb/loadBalancer:LoadBalancer::evalplane-pkg-index-alb
evalplane:gateway:Gateway$aws:lb/targetGroup:TargetGroup::evalplane-gateway-tg
evalplane:eval:PackageIndex$aws:lb/targetGroup:TargetGroup::evalplane-pkg-index-tg
"""
URNS = [line.strip() for line in URNS_TEXT.strip().splitlines()]
TYPES = {u.split("$")[1].split("::")[0] for u in URNS}


def test_the_repeated_blocks_are_declared_by_the_helpers_only():
    for path in sorted((ROOT / "components").glob("*.py")):
        if path.name == "tiers.py":
            continue
        src = path.read_text()
        for ctor, allowed in HELPER_MADE.items():
            if re.search(re.escape(ctor) + r"\(", src):
                assert path.name in allowed, f"{path.name} declares {ctor} itself: use components/tiers.py"


def test_the_blocks_keep_their_urns(estate_snapshot):
    urns = sorted(r.urn.split("::", 2)[2] for r in estate_snapshot.custom() if r.typ in TYPES)
    assert urns == sorted(URNS)
    assert all(r.urn.startswith("urn:pulumi:test::evalplane::evalplane:") for r in estate_snapshot.custom())


def test_one_shape_for_every_ecs_tier(estate_snapshot):
    s = estate_snapshot
    groups = {r.inputs["name"] for r in s.of("aws:cloudwatch/logGroup:LogGroup")}
    for cluster in s.of("aws:ecs/cluster:Cluster"):
        assert cluster.inputs["settings"] == [{"name": "containerInsights", "value": "enabled"}], cluster.name
    for td in s.of("aws:ecs/taskDefinition:TaskDefinition"):
        fargate = td.inputs["requiresCompatibilities"] == ["FARGATE"]
        assert td.inputs["networkMode"] == ("awsvpc" if fargate else "bridge"), td.name
        for container in json.loads(td.inputs["containerDefinitions"]):
            logging = container["logConfiguration"]
            assert logging["logDriver"] == "awslogs" and logging["options"]["awslogs-group"] in groups, td.name
            assert logging["options"]["awslogs-region"] == "us-east-1", td.name
    assert "taskRoleArn" not in s.one("aws:ecs/taskDefinition:TaskDefinition", "evalplane-pkg-index-task").inputs


def test_one_shape_for_every_load_balanced_service(estate_snapshot):
    s = estate_snapshot
    lbs = {r.id: r for r in s.of("aws:lb/loadBalancer:LoadBalancer")}
    assert len(lbs) == 2
    for lb in lbs.values():
        assert lb.inputs["internal"] is True and lb.inputs["dropInvalidHeaderFields"] is True, lb.name
    for svc in s.of("aws:ecs/service:Service"):
        if svc.name == "evalplane-eval-service":
            continue
        assert svc.inputs["launchType"] == "FARGATE"
        assert svc.inputs["networkConfiguration"]["assignPublicIp"] is False
        assert svc.inputs["deploymentCircuitBreaker"] == {"enable": True, "rollback": True}
    gw = s.one("aws:lb/listener:Listener", "evalplane-gateway-listener")
    assert [a["type"] for a in gw.inputs["defaultActions"]] == ["forward"]
    index = s.one("aws:lb/listener:Listener", "evalplane-pkg-index-listener")
    assert [a["type"] for a in index.inputs["defaultActions"]] == ["fixed-response"]


def test_one_shape_for_every_autoscaling_tier(estate_snapshot):
    s = estate_snapshot
    asgs = {r.inputs["name"]: r for r in s.of("aws:autoscaling/group:Group")}
    assert set(asgs) == {"evalplane-eval", "evalplane-build"}
    for asg in asgs.values():
        assert asg.inputs["minSize"] == 0 and asg.inputs["launchTemplate"]["version"] == "$Latest", asg.name
    assert asgs["evalplane-build"].inputs["desiredCapacity"] == 0  # a plain tier starts at zero
    eval_tags = {t["key"]: t["value"] for t in asgs["evalplane-eval"].inputs["tags"]}
    assert eval_tags["AmazonECSManaged"] == "true" and "desiredCapacity" not in asgs["evalplane-eval"].inputs
    (cp,) = s.of("aws:ecs/capacityProvider:CapacityProvider")
    assert cp.inputs["autoScalingGroupProvider"]["managedScaling"]["status"] == "ENABLED"
