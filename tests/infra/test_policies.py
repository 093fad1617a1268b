"""The CrossGuard policy pack: each policy with passing and failing inputs, then over the mocked estate.

Never construct PolicyPack here: its constructor serves gRPC forever.
"""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws
import pytest
from policy_bridge import _opts, resource_args, run_resource_policies, run_stack_policies
from pulumi_policy import PolicyResource, StackValidationArgs

from components import estate
from components.config import EstateConfig
from policy import rules as R


class Rec:  # the shape resource_args/run_* expect
    def __init__(self, typ, inputs, name="r", custom=True, id=None):
        self.typ, self.inputs, self.name, self.custom, self.urn = typ, inputs, name, custom, f"urn:x::{name}"
        self.id, self.outputs = id or f"{name}-id", dict(inputs)


def violations(policy, typ, props):
    found: list[str] = []
    policy.validate(resource_args(Rec(typ, props)), lambda msg, urn=None: found.append(msg))
    return found


def stack_violations(policy, resources):
    found: list[str] = []
    policy.validate(StackValidationArgs(resources), lambda msg, urn=None: found.append(msg))
    return found


def pres(typ, props, name, deps=None):
    return PolicyResource(typ, props, f"urn:x::{name}", name, _opts(), None, None, [], deps or {})


ISOLATED = {"evalplane:egress": "none", "evalplane:tier": "harness"}


# ---------------------------------------------------------------------------- resource policies
@pytest.mark.parametrize(
    "policy,typ,good,bad",
    [
        (R.isolated_route_tables, R.T_ROUTE_TABLE,
         {"routes": [], "tags": ISOLATED},
         {"routes": [{"cidrBlock": "0.0.0.0/0", "natGatewayId": "nat-1"}], "tags": ISOLATED}),
        (R.isolated_route_tables, R.T_ROUTE_TABLE,
         {"routes": [{"cidrBlock": "0.0.0.0/0"}], "tags": {"evalplane:egress": "nat"}},
         {"routes": [{"ipv6CidrBlock": "::/0", "egressOnlyGatewayId": "eigw"}], "tags": ISOLATED}),
        (R.isolated_route_tables, R.T_ROUTE_TABLE, {"tags": ISOLATED}, {"tags": {}}),
        (R.subnets_private, R.T_SUBNET,
         {"mapPublicIpOnLaunch": False, "tags": ISOLATED},
         {"mapPublicIpOnLaunch": True, "tags": ISOLATED}),
        (R.subnets_private, R.T_SUBNET,
         {"tags": {"evalplane:tier": "gateway", "evalplane:egress": "nat"}},
         {"tags": {"evalplane:tier": "harness", "evalplane:egress": "nat"}}),
        (R.interface_endpoints_private_dns, R.T_ENDPOINT,
         {"vpcEndpointType": "Interface", "privateDnsEnabled": True, "serviceName": "com.amazonaws.us-east-1.sqs"},
         {"vpcEndpointType": "Interface", "privateDnsEnabled": False, "serviceName": "com.amazonaws.us-east-1.sqs"}),
        (R.eval_requires_ec2, R.T_TASKDEF,
         {"requiresCompatibilities": ["EC2"], "networkMode": "bridge", "tags": {"evalplane:tier": "eval"}},
         {"requiresCompatibilities": ["EC2", "FARGATE"], "networkMode": "bridge", "tags": {"evalplane:tier": "eval"}}),
        (R.eval_requires_ec2, R.T_TASKDEF,
         {"requiresCompatibilities": ["FARGATE"], "networkMode": "awsvpc", "tags": {"evalplane:tier": "harness"}},
         {"requiresCompatibilities": ["FARGATE"], "networkMode": "awsvpc",
          "volumes": [{"name": "d", "hostPath": "/var/run/docker.sock"}]}),
        (R.no_public_ip, R.T_SERVICE,
         {"networkConfiguration": {"subnets": ["s"], "assignPublicIp": False}},
         {"networkConfiguration": {"subnets": ["s"], "assignPublicIp": True}}),
        (R.no_public_ip, R.T_LT,
         {"networkInterfaces": [{"associatePublicIpAddress": "false"}]},
         {"networkInterfaces": [{"associatePublicIpAddress": "true"}]}),
        (R.no_public_ip, R.T_INSTANCE, {"associatePublicIpAddress": False}, {"associatePublicIpAddress": True}),
        (R.asg_min_zero, R.T_ASG, {"minSize": 0, "maxSize": 5}, {"minSize": 1, "maxSize": 5}),
        (R.encryption_at_rest, R.T_RDS,
         {"storageEncrypted": True, "manageMasterUserPassword": True},
         {"storageEncrypted": False, "manageMasterUserPassword": True}),
        (R.encryption_at_rest, R.T_RDS,
         {"storageEncrypted": True, "manageMasterUserPassword": True},
         {"storageEncrypted": True, "masterPassword": "hunter2"}),
        (R.encryption_at_rest, R.T_VALKEY,
         {"transitEncryptionEnabled": True, "atRestEncryptionEnabled": True},
         {"transitEncryptionEnabled": False, "atRestEncryptionEnabled": True}),
        (R.encryption_at_rest, R.T_VALKEY,
         {"transitEncryptionEnabled": True, "atRestEncryptionEnabled": True},
         {"transitEncryptionEnabled": True}),
        (R.encryption_at_rest, R.T_SECRET, {"kmsKeyId": "arn:aws:kms:k"}, {"name": "s"}),
        (R.encryption_at_rest, R.T_SSE,
         {"rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "aws:kms"}}]},
         {"rules": []}),
        (R.encryption_at_rest, R.T_LT,
         {"blockDeviceMappings": [{"deviceName": "/dev/xvda", "ebs": {"encrypted": "true"}}]},
         {"blockDeviceMappings": [{"deviceName": "/dev/xvda", "ebs": {"volumeSize": 100}}]}),
        (R.ecr_immutable, R.T_ECR,
         {"imageTagMutability": "IMMUTABLE", "imageScanningConfiguration": {"scanOnPush": True}},
         {"imageTagMutability": "MUTABLE", "imageScanningConfiguration": {"scanOnPush": True}}),
        (R.ecr_immutable, R.T_ECR,
         {"imageTagMutability": "IMMUTABLE", "imageScanningConfiguration": {"scanOnPush": True}},
         {"imageTagMutability": "IMMUTABLE"}),
        (R.iam_least_privilege, R.T_ROLE_POLICY,
         {"name": "harness-exec", "policy": json.dumps({"Statement": [
             {"Effect": "Allow", "Action": ["ecr:GetAuthorizationToken"], "Resource": "*"}]})},
         {"name": "harness-task", "policy": json.dumps({"Statement": [
             {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "*"}]})}),
        (R.iam_least_privilege, R.T_ROLE_POLICY,
         {"name": "harness-task", "policy": json.dumps({"Statement": [
             {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "arn:aws:s3:::b/runs/*"}]})},
         {"name": "harness-task", "policy": json.dumps({"Statement": [
             {"Effect": "Allow", "Action": "*", "Resource": "arn:aws:s3:::b/runs/*"}]})}),
        (R.iam_least_privilege, R.T_ROLE, {"assumeRolePolicy": "{}"},
         {"assumeRolePolicy": "{}", "managedPolicyArns": ["arn:aws:iam::aws:policy/AdministratorAccess"]}),
    ],
)
def test_resource_policy_passes_good_and_catches_bad(policy, typ, good, bad):
    assert violations(policy, typ, good) == []
    assert violations(policy, typ, bad)


def test_policy_attachments_are_rejected():
    assert violations(R.iam_least_privilege, R.T_ROLE_ATTACH, {"role": "r", "policyArn": "arn:aws:iam::aws:policy/x"})


def test_resource_policies_ignore_other_types():
    for pol in R.RESOURCE_POLICIES:
        assert violations(pol, "aws:sqs/queue:Queue", {"name": "q"}) == []


# ------------------------------------------------------------------------------- stack policies
def test_stack_policy_default_route_into_isolated_table():
    iso = pres(R.T_ROUTE_TABLE, {"tags": ISOLATED, "id": "rt-iso"}, "iso")
    nat = pres(R.T_ROUTE_TABLE, {"tags": {"evalplane:egress": "nat"}, "id": "rt-nat"}, "nat")
    ok = pres(R.T_ROUTE, {"routeTableId": "rt-nat", "destinationCidrBlock": "0.0.0.0/0"}, "ok", {"routeTableId": [nat]})
    bad = pres(R.T_ROUTE, {"routeTableId": "rt-iso", "destinationCidrBlock": "0.0.0.0/0"}, "bad", {"routeTableId": [iso]})
    bad6 = pres(R.T_ROUTE, {"routeTableId": "rt-iso", "destinationIpv6CidrBlock": "::/0"}, "bad6")  # found by id
    assert stack_violations(R.no_default_route_into_isolated, [iso, nat, ok]) == []
    assert len(stack_violations(R.no_default_route_into_isolated, [iso, nat, ok, bad, bad6])) == 2


def test_stack_policy_isolated_subnet_on_a_nat_table():
    sn = pres(R.T_SUBNET, {"tags": ISOLATED, "id": "sn"}, "sn")
    iso = pres(R.T_ROUTE_TABLE, {"tags": ISOLATED, "id": "rt-iso"}, "iso")
    nat = pres(R.T_ROUTE_TABLE, {"tags": {"evalplane:egress": "nat"}, "id": "rt-nat"}, "nat")
    good = pres(R.T_RTA, {"subnetId": "sn", "routeTableId": "rt-iso"}, "good")
    bad = pres(R.T_RTA, {"subnetId": "sn", "routeTableId": "rt-nat"}, "bad")
    assert stack_violations(R.no_default_route_into_isolated, [sn, iso, nat, good]) == []
    assert stack_violations(R.no_default_route_into_isolated, [sn, iso, nat, bad])


def test_stack_policy_required_endpoints():
    def ep(svc, typ="Interface", dns=True):
        p = {"serviceName": f"com.amazonaws.us-east-1.{svc}", "vpcEndpointType": typ, "privateDnsEnabled": dns}
        if typ == "Gateway":
            p["routeTableIds"] = ["rt-1"]
        return pres(R.T_ENDPOINT, p, svc)

    full = [ep("s3", "Gateway", None)] + [ep(s) for s in R.REQUIRED_INTERFACE_ENDPOINTS]
    assert stack_violations(R.required_endpoints, full) == []
    missing = [e for e in full if e.name != "sts"]
    assert stack_violations(R.required_endpoints, missing) == ["missing interface endpoint sts with private DNS"]
    no_dns = [e for e in full if e.name != "logs"] + [ep("logs", dns=False)]
    assert stack_violations(R.required_endpoints, no_dns)
    assert stack_violations(R.required_endpoints, full[1:])  # no S3 gateway


def test_stack_policy_bucket_guardrails():
    b = pres(R.T_BUCKET, {"id": "b1", "bucket": "b1"}, "b")
    sse = pres(R.T_SSE, {"bucket": "b1", "rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}]}, "sse")
    flags = {"blockPublicAcls": True, "blockPublicPolicy": True, "ignorePublicAcls": True, "restrictPublicBuckets": True}
    pab = pres(R.T_PAB, {"bucket": "b1", **flags}, "pab")
    weak = pres(R.T_PAB, {"bucket": "b1", **flags, "restrictPublicBuckets": False}, "weak")
    assert stack_violations(R.bucket_guardrails, [b, sse, pab]) == []
    assert len(stack_violations(R.bucket_guardrails, [b])) == 2
    assert stack_violations(R.bucket_guardrails, [b, sse, weak])


# --------------------------------------------------------------------- over the mocked estate
def test_every_recorded_resource_passes_every_policy(estate_snapshot):
    assert run_resource_policies(R.RESOURCE_POLICIES, estate_snapshot.created) == []
    assert run_stack_policies(R.STACK_POLICIES, estate_snapshot.created) == []
    assert len(R.POLICIES) == len({p.name for p in R.POLICIES})


def test_a_deliberately_bad_estate_is_caught(pulumi_mocks):
    @pulumi.runtime.test
    def build():
        out = estate.build(EstateConfig())
        vpc = aws.ec2.Vpc("rogue-vpc", cidr_block="10.99.0.0/16")
        rt = aws.ec2.RouteTable("rogue-rt", vpc_id=vpc.id, tags={"evalplane:egress": "none"})
        # a default route slipped into the harness route table, and a public-IP service
        aws.ec2.Route("rogue-default", route_table_id="evalplane-harness-rt-id",
                      destination_cidr_block="0.0.0.0/0", gateway_id="igw-x")
        aws.ec2.Route("rogue-v6", route_table_id=rt.id, destination_ipv6_cidr_block="::/0", gateway_id="igw-x")
        aws.ecs.Service("rogue-svc", cluster="c", task_definition="td", desired_count=1,
                        network_configuration={"subnets": ["s"], "assign_public_ip": True})
        aws.autoscaling.Group("rogue-asg", min_size=1, max_size=2, availability_zones=["us-east-1a"])
        aws.iam.RolePolicy("rogue-policy", role="r", name="harness-task",
                           policy=json.dumps({"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        return pulumi.Output.from_input(out)

    build()
    pulumi_mocks.attach_urns()
    created = pulumi_mocks.mocks.created
    res = run_resource_policies(R.RESOURCE_POLICIES, created)
    stack = run_stack_policies(R.STACK_POLICIES, created)
    by_resource = {(p, n) for p, n, _ in res}
    assert ("no-public-ip", "rogue-svc") in by_resource
    assert ("asg-min-zero", "rogue-asg") in by_resource
    assert ("iam-least-privilege", "rogue-policy") in by_resource
    assert all(n.startswith("rogue") for _, n, _ in res), res
    flagged = {urn.rsplit("::", 1)[-1] for p, urn, _ in stack if p == "no-default-route-into-isolated-subnets"}
    assert flagged == {"rogue-default", "rogue-v6"}
