"""evalplane's guardrails as CrossGuard policies (pulumi-policy), importable without starting a pack.

`policy/__main__.py` only wraps POLICIES in a PolicyPack (its constructor serves gRPC forever, so tests
never build one); tests call each policy's `validate` directly and over every resource the Pulumi mocks
recorded. Resource policies see a resource's inputs with camelCase wire names (`cidrBlock`, `routes`,
`requiresCompatibilities`); stack policies see every resource plus its dependencies.

This module depends on pulumi-policy only (the pack runs in its own virtualenv), so the tag names and the
IAM allow-list are defined here; components/common.py uses the same tag strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

TIER_TAG = "evalplane:tier"
EGRESS_TAG = "evalplane:egress"
EGRESS_VALUES = ("none", "nat", "igw")
DEFAULT_V4, DEFAULT_V6 = "0.0.0.0/0", "::/0"
REQUIRED_INTERFACE_ENDPOINTS = ("sqs", "ecr.api", "ecr.dkr", "logs", "secretsmanager", "sts")
MANDATORY = EnforcementLevel.MANDATORY

T_ROUTE = "aws:ec2/route:Route"
T_ROUTE_TABLE = "aws:ec2/routeTable:RouteTable"
T_RTA = "aws:ec2/routeTableAssociation:RouteTableAssociation"
T_SUBNET = "aws:ec2/subnet:Subnet"
T_ENDPOINT = "aws:ec2/vpcEndpoint:VpcEndpoint"
T_TASKDEF = "aws:ecs/taskDefinition:TaskDefinition"
T_SERVICE = "aws:ecs/service:Service"
T_LT = "aws:ec2/launchTemplate:LaunchTemplate"
T_INSTANCE = "aws:ec2/instance:Instance"
T_RDS = "aws:rds/cluster:Cluster"
T_VALKEY = "aws:elasticache/replicationGroup:ReplicationGroup"
T_SECRET = "aws:secretsmanager/secret:Secret"
T_BUCKET = "aws:s3/bucket:Bucket"
T_BUCKET_V2 = "aws:s3/bucketV2:BucketV2"
T_SSE = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
T_PAB = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
T_ASG = "aws:autoscaling/group:Group"
T_ECR = "aws:ecr/repository:Repository"
T_ROLE = "aws:iam/role:Role"
T_ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
T_ROLE_ATTACH = "aws:iam/rolePolicyAttachment:RolePolicyAttachment"
T_POLICY_ATTACH = "aws:iam/policyAttachment:PolicyAttachment"
T_SG = "aws:ec2/securityGroup:SecurityGroup"
T_SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
T_SG_INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
T_SG_EGRESS = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"

# The security groups (by their tier tag, components/security.py) that may open egress to the internet: each sits
# in the NAT subnets and needs it (gateway tasks: model providers; builders: official images; the package index's
# tasks: its upstream).
OPEN_EGRESS_TIERS = ("gateway_task", "build", "package_index_task")

# Where an IAM statement may use Resource "*": per role policy (its `name`), the actions that have no
# resource-level permissions in IAM, why the tier needs them, and the condition key that must narrow
# them when one exists. Anything else with "*" (in an action or as the whole resource) is a violation.
ECR_AUTH = ("ecr:GetAuthorizationToken", "pull/push images: the registry auth token has no resource type", None)
ECS_AGENT = ("ecs:DiscoverPollEndpoint", "the ECS agent on eval hosts: no resource type", None)
LIST_TASKS = ("ecs:ListTasks", "list a cluster's tasks: resource '*', narrowed by ecs:cluster", "ecs:cluster")
DESCRIBE_TD = ("ecs:DescribeTaskDefinition",
               "read the harness template a task image's revision derives from: no resource type", None)
REGISTER_TD = ("ecs:RegisterTaskDefinition",
               ("one revision per task image (RunTask cannot override an image): no resource type, narrowed by the "
                "tier tag the revision must carry"),
               "aws:RequestTag/evalplane:tier")
WILDCARD_ALLOWLIST: dict[str, dict[str, tuple[str, str | None]]] = {
    "harness-exec": {ECR_AUTH[0]: ECR_AUTH[1:]},
    "harness-task": {},
    "gateway-exec": {ECR_AUTH[0]: ECR_AUTH[1:]},  # its image is in <prefix>/platform (the gateway/ plugin code)
    "gateway-task": {},
    "eval-instance": {ECR_AUTH[0]: ECR_AUTH[1:], ECS_AGENT[0]: ECS_AGENT[1:]},
    "eval-exec": {ECR_AUTH[0]: ECR_AUTH[1:]},
    "eval-task": {ECR_AUTH[0]: ECR_AUTH[1:]},  # the worker pulls per-instance images via the host's Docker
    "judge-exec": {ECR_AUTH[0]: ECR_AUTH[1:]},
    "judge-task": {},
    "package-index-exec": {ECR_AUTH[0]: ECR_AUTH[1:]},  # no task role: proxpi calls no AWS API
    "dispatcher": {ECR_AUTH[0]: ECR_AUTH[1:], LIST_TASKS[0]: LIST_TASKS[1:], DESCRIBE_TD[0]: DESCRIBE_TD[1:],
                   REGISTER_TD[0]: REGISTER_TD[1:]},
    "build-instance": {ECR_AUTH[0]: ECR_AUTH[1:]},
    "guard": {LIST_TASKS[0]: LIST_TASKS[1:]},
    "guard-scheduler": {},
}


# ---------------------------------------------------------------------------------------- helpers
def _tags(props: Mapping[str, Any]) -> Mapping[str, Any]:
    return props.get("tags") or {}


def _truthy(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.lower() == "true")


def _is_default(route: Mapping[str, Any]) -> bool:
    return (
        route.get("cidrBlock") == DEFAULT_V4
        or route.get("ipv6CidrBlock") == DEFAULT_V6
        or route.get("destinationCidrBlock") == DEFAULT_V4
        or route.get("destinationIpv6CidrBlock") == DEFAULT_V6
    )


def _resource_policy(name: str, description: str, types: Iterable[str], check: Callable) -> ResourceValidationPolicy:
    wanted = set(types)

    def validate(args: ResourceValidationArgs, report: ReportViolation) -> None:
        if args.resource_type in wanted:
            for msg in check(args.resource_type, args.props):
                report(msg, None)

    return ResourceValidationPolicy(name=name, description=description, validate=validate, enforcement_level=MANDATORY)


def _linked(res: PolicyResource, prop: str, typ: str, all_resources: list[PolicyResource]) -> list[PolicyResource]:
    """The resources of type `typ` that `res.props[prop]` refers to (property dependencies, else by id)."""
    deps = (res.property_dependencies or {}).get(prop) or []
    found = [d for d in deps if d.resource_type == typ]
    if found:
        return found
    ref = res.props.get(prop)
    return [r for r in all_resources if r.resource_type == typ and ref is not None and r.props.get("id") == ref]


# ------------------------------------------------------------------------------ network: routes
def _check_route_table(_t: str, props: Mapping[str, Any]) -> Iterable[str]:
    egress = _tags(props).get(EGRESS_TAG)
    if egress not in EGRESS_VALUES:
        yield f"route table must carry tag {EGRESS_TAG} in {EGRESS_VALUES} (got {egress!r})"
    if egress == "none":
        for r in props.get("routes") or []:
            if _is_default(r):
                yield "isolated route table (egress=none) has an inline default route"


isolated_route_tables = _resource_policy(
    "isolated-route-tables-no-default-route",
    "Every route table declares its egress; isolated ones (harness, eval, head, data) have no 0.0.0.0/0 or ::/0.",
    [T_ROUTE_TABLE],
    _check_route_table,
)


def _validate_routes(args: StackValidationArgs, report: ReportViolation) -> None:
    rs = list(args.resources)
    for res in rs:
        if res.resource_type == T_ROUTE and _is_default(res.props):
            for rt in _linked(res, "routeTableId", T_ROUTE_TABLE, rs):
                if _tags(rt.props).get(EGRESS_TAG) != "nat" and _tags(rt.props).get(EGRESS_TAG) != "igw":
                    report(f"default route {res.name} targets route table {rt.name} that is not an egress table", res.urn)
        if res.resource_type == T_RTA:
            subnets = _linked(res, "subnetId", T_SUBNET, rs)
            tables = _linked(res, "routeTableId", T_ROUTE_TABLE, rs)
            for sn in subnets:
                for rt in tables:
                    if _tags(sn.props).get(EGRESS_TAG) != _tags(rt.props).get(EGRESS_TAG):
                        report(
                            f"subnet {sn.name} (egress={_tags(sn.props).get(EGRESS_TAG)}) is associated with "
                            f"route table {rt.name} (egress={_tags(rt.props).get(EGRESS_TAG)})",
                            res.urn,
                        )


no_default_route_into_isolated = StackValidationPolicy(
    name="no-default-route-into-isolated-subnets",
    description="Standalone default routes only on NAT/IGW route tables; subnets only join tables of their egress class.",
    validate=_validate_routes,
    enforcement_level=MANDATORY,
)


def _check_subnet(_t: str, props: Mapping[str, Any]) -> Iterable[str]:
    if _truthy(props.get("mapPublicIpOnLaunch")):
        yield "subnet maps public IPs on launch"
    if _truthy(props.get("assignIpv6AddressOnCreation")):
        yield "subnet assigns IPv6 addresses on creation"
    if _tags(props).get(TIER_TAG) == "harness" and _tags(props).get(EGRESS_TAG) != "none":
        yield "harness subnets must be isolated (egress=none)"


subnets_private = _resource_policy(
    "subnets-no-public-ip", "No subnet maps public IPs; harness subnets are isolated.", [T_SUBNET], _check_subnet
)


# ------------------------------------------------------------------------------ network: endpoints
def _check_endpoint(_t: str, props: Mapping[str, Any]) -> Iterable[str]:
    if props.get("vpcEndpointType") == "Interface" and not _truthy(props.get("privateDnsEnabled")):
        yield f"interface endpoint {props.get('serviceName')} without private DNS"


interface_endpoints_private_dns = _resource_policy(
    "interface-endpoints-private-dns", "Interface VPC endpoints enable private DNS.", [T_ENDPOINT], _check_endpoint
)


def _validate_required_endpoints(args: StackValidationArgs, report: ReportViolation) -> None:
    eps = [r.props for r in args.resources if r.resource_type == T_ENDPOINT]
    svc = lambda p: str(p.get("serviceName") or "")
    if not any(svc(p).endswith(".s3") and p.get("vpcEndpointType") == "Gateway" and p.get("routeTableIds") for p in eps):
        report("missing the S3 gateway endpoint on the isolated route tables", None)
    for name in REQUIRED_INTERFACE_ENDPOINTS:
        if not any(
            svc(p).endswith(f".{name}") and p.get("vpcEndpointType") == "Interface" and _truthy(p.get("privateDnsEnabled"))
            for p in eps
        ):
            report(f"missing interface endpoint {name} with private DNS", None)


required_endpoints = StackValidationPolicy(
    name="required-vpc-endpoints",
    description="S3 gateway endpoint plus interface endpoints (private DNS) for " + ", ".join(REQUIRED_INTERFACE_ENDPOINTS),
    validate=_validate_required_endpoints,
    enforcement_level=MANDATORY,
)


# ------------------------------------------------------------------------------------ compute
def _host_docker(props: Mapping[str, Any]) -> bool:
    return any("docker.sock" in str(v.get("hostPath", "")) for v in props.get("volumes") or [])


def _check_task_definition(_t: str, props: Mapping[str, Any]) -> Iterable[str]:
    eval_tier = _tags(props).get(TIER_TAG) == "eval"
    if (eval_tier or _host_docker(props)) and list(props.get("requiresCompatibilities") or []) != ["EC2"]:
        yield "eval task definitions (Docker on the host) must require EC2 exactly"
    if not eval_tier and props.get("networkMode") != "awsvpc":
        yield "Fargate task definitions use awsvpc networking"


eval_requires_ec2 = _resource_policy(
    "eval-task-definition-requires-ec2",
    "The eval worker's task definition requires EC2 (ADR-0012); the others are awsvpc.",
    [T_TASKDEF],
    _check_task_definition,
)


def _check_public_ip(t: str, props: Mapping[str, Any]) -> Iterable[str]:
    if t == T_SERVICE and _truthy((props.get("networkConfiguration") or {}).get("assignPublicIp")):
        yield "ECS service assigns public IPs"
    if t == T_LT:
        for ni in props.get("networkInterfaces") or []:
            if _truthy(ni.get("associatePublicIpAddress")):
                yield "launch template associates a public IP"
    if t == T_INSTANCE and _truthy(props.get("associatePublicIpAddress")):
        yield "instance has a public IP"


no_public_ip = _resource_policy(
    "no-public-ip",
    "No ECS service, launch template or instance gets a public IP.",
    [T_SERVICE, T_LT, T_INSTANCE],
    _check_public_ip,
)


def _check_asg(_t: str, props: Mapping[str, Any]) -> Iterable[str]:
    if props.get("minSize") not in (0, 0.0):
        yield f"Auto Scaling group minSize is {props.get('minSize')!r}, must be 0 (the guard scales to zero)"


asg_min_zero = _resource_policy("asg-min-zero", "Every Auto Scaling group can reach zero.", [T_ASG], _check_asg)


# --------------------------------------------------------------------------------- encryption
def _check_encryption(t: str, props: Mapping[str, Any]) -> Iterable[str]:
    if t == T_RDS and not _truthy(props.get("storageEncrypted")):
        yield "Aurora storage is not encrypted"
    if t == T_RDS and not (_truthy(props.get("manageMasterUserPassword")) or props.get("masterPassword") is None):
        yield "Aurora master password must live in Secrets Manager (manageMasterUserPassword)"
    if t == T_VALKEY:
        if not _truthy(props.get("transitEncryptionEnabled")):
            yield "Valkey transit encryption is off"
        if not _truthy(props.get("atRestEncryptionEnabled")):
            yield "Valkey at-rest encryption is off"
    if t == T_SECRET and not props.get("kmsKeyId"):
        yield "secret is not encrypted with the estate's KMS key"
    if t == T_SSE:
        algs = [
            ((r.get("applyServerSideEncryptionByDefault") or {}).get("sseAlgorithm"))
            for r in props.get("rules") or []
        ]
        if not algs or not all(a in ("aws:kms", "aws:kms:dsse", "AES256") for a in algs):
            yield "bucket SSE rule missing or without an algorithm"
    if t == T_LT:
        for bd in props.get("blockDeviceMappings") or []:
            if not _truthy((bd.get("ebs") or {}).get("encrypted")):
                yield f"launch template volume {bd.get('deviceName')} is not encrypted"
    if t == T_INSTANCE and props.get("rootBlockDevice") and not _truthy(props["rootBlockDevice"].get("encrypted")):
        yield "instance root volume is not encrypted"


encryption_at_rest = _resource_policy(
    "encryption-on",
    "Aurora storage, Valkey transit and rest, bucket SSE, secrets (KMS), EBS volumes are encrypted.",
    [T_RDS, T_VALKEY, T_SECRET, T_SSE, T_LT, T_INSTANCE],
    _check_encryption,
)


def _validate_buckets(args: StackValidationArgs, report: ReportViolation) -> None:
    rs = list(args.resources)
    for b in rs:
        if b.resource_type not in (T_BUCKET, T_BUCKET_V2):
            continue
        names = {b.props.get("id"), b.props.get("bucket")} - {None}
        sses = [
            r for r in rs
            if r.resource_type == T_SSE and (b in _linked(r, "bucket", b.resource_type, rs) or r.props.get("bucket") in names)
        ]
        pabs = [
            r for r in rs
            if r.resource_type == T_PAB and (b in _linked(r, "bucket", b.resource_type, rs) or r.props.get("bucket") in names)
        ]
        if not sses:
            report(f"bucket {b.name} has no server-side encryption configuration", b.urn)
        flags = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
        if not any(all(_truthy(p.props.get(f)) for f in flags) for p in pabs):
            report(f"bucket {b.name} has no complete public access block", b.urn)


bucket_guardrails = StackValidationPolicy(
    name="bucket-sse-and-public-access-block",
    description="Every bucket has SSE and a full public access block.",
    validate=_validate_buckets,
    enforcement_level=MANDATORY,
)


def _check_ecr(_t: str, props: Mapping[str, Any]) -> Iterable[str]:
    if props.get("imageTagMutability") != "IMMUTABLE":
        yield "ECR repository tags must be IMMUTABLE"
    if not _truthy((props.get("imageScanningConfiguration") or {}).get("scanOnPush")):
        yield "ECR repository must scan on push"


ecr_immutable = _resource_policy("ecr-immutable-scan-on-push", "ECR: immutable tags, scan on push.", [T_ECR], _check_ecr)


# ------------------------------------------------------------------------------ security groups
def _open_cidrs(props: Mapping[str, Any], v4: str, v6: str) -> bool:
    return any(c == DEFAULT_V4 for c in _listify(props.get(v4) or [])) or any(
        c == DEFAULT_V6 for c in _listify(props.get(v6) or []))


def _validate_internet_rules(args: StackValidationArgs, report: ReportViolation) -> None:
    rs = list(args.resources)

    def open_egress(group: PolicyResource, what: str, urn: str | None) -> None:
        tier = _tags(group.props).get(TIER_TAG)
        if tier not in OPEN_EGRESS_TIERS:
            report(f"{what} opens egress to the internet from security group {group.name} (tier {tier!r}); only "
                   f"{', '.join(OPEN_EGRESS_TIERS)} may", urn)

    for res in rs:
        t, props = res.resource_type, res.props
        if t == T_SG:
            for block in props.get("ingress") or []:
                if _open_cidrs(block, "cidrBlocks", "ipv6CidrBlocks"):
                    report(f"security group {res.name} takes ingress from the internet", res.urn)
            if any(_open_cidrs(block, "cidrBlocks", "ipv6CidrBlocks") for block in props.get("egress") or []):
                open_egress(res, f"an inline egress rule of {res.name}", res.urn)
        elif t in (T_SG_INGRESS, T_SG_EGRESS) and _open_cidrs(props, "cidrIpv4", "cidrIpv6"):
            if t == T_SG_INGRESS:
                report(f"{res.name} takes ingress from the internet", res.urn)
            else:
                for group in _linked(res, "securityGroupId", T_SG, rs):
                    open_egress(group, res.name, res.urn)
        elif t == T_SG_RULE and _open_cidrs(props, "cidrBlocks", "ipv6CidrBlocks"):
            if props.get("type") == "ingress":
                report(f"{res.name} takes ingress from the internet", res.urn)
            else:
                for group in _linked(res, "securityGroupId", T_SG, rs):
                    open_egress(group, res.name, res.urn)


internet_rules = StackValidationPolicy(
    name="internet-egress-only-from-nat-tiers",
    description=("No security group takes ingress from the internet; egress to 0.0.0.0/0 or ::/0 only from the "
                 "NAT tiers' groups: " + ", ".join(OPEN_EGRESS_TIERS) + "."),
    validate=_validate_internet_rules,
    enforcement_level=MANDATORY,
)


# ------------------------------------------------------------------------------------------ IAM
FULL_WILDCARD_ARN = re.compile(r"^arn:aws[a-z-]*:[^:]*:[^:]*:[^:]*:\*$")


def _listify(v: Any) -> list:
    return v if isinstance(v, list) else [v]


def iam_violations(policy_name: str, document: str | Mapping[str, Any]) -> list[str]:
    """Why a role policy breaks least privilege (empty if it does not). Used by the policy and the tests."""
    doc = json.loads(document) if isinstance(document, str) else document
    allowed = WILDCARD_ALLOWLIST.get(policy_name)
    out: list[str] = []
    if allowed is None:
        return [f"role policy {policy_name!r} is not in the allow-list (policy/rules.py WILDCARD_ALLOWLIST)"]
    for st in _listify(doc.get("Statement", [])):
        if st.get("Effect") != "Allow":
            continue
        if "NotAction" in st or "NotResource" in st:
            out.append(f"{policy_name}: NotAction/NotResource are not allowed")
        actions = [str(a) for a in _listify(st.get("Action", []))]
        resources = [str(r) for r in _listify(st.get("Resource", []))]
        for a in actions:
            if "*" in a:
                out.append(f"{policy_name}: wildcard action {a!r}")
        if any(r == "*" or FULL_WILDCARD_ARN.match(r) for r in resources):
            for a in actions:
                if a not in allowed:
                    out.append(f"{policy_name}: {a} on Resource '*' is not in the allow-list")
                else:
                    need = allowed[a][1]
                    conds = st.get("Condition") or {}
                    if need and not any(need in block for block in conds.values()):
                        out.append(f"{policy_name}: {a} on '*' must be narrowed by condition {need}")
    return out


def _check_iam(t: str, props: Mapping[str, Any]) -> Iterable[str]:
    if t == T_ROLE_POLICY:
        doc = props.get("policy")
        if isinstance(doc, str):  # unknown during some previews: nothing to check yet
            yield from iam_violations(str(props.get("name")), doc)
    if t == T_ROLE and props.get("managedPolicyArns"):
        yield "roles carry inline, reviewable policies only (no managed policy ARNs)"
    if t in (T_ROLE_ATTACH, T_POLICY_ATTACH):
        yield "managed policy attachments are not allowed: use one inline policy per role"


iam_least_privilege = _resource_policy(
    "iam-least-privilege",
    "No '*' action; Resource '*' only for the allow-listed actions of each tier; no managed policies.",
    [T_ROLE_POLICY, T_ROLE, T_ROLE_ATTACH, T_POLICY_ATTACH],
    _check_iam,
)


RESOURCE_POLICIES = [
    isolated_route_tables,
    subnets_private,
    interface_endpoints_private_dns,
    eval_requires_ec2,
    no_public_ip,
    asg_min_zero,
    encryption_at_rest,
    ecr_immutable,
    iam_least_privilege,
]
STACK_POLICIES = [no_default_route_into_isolated, required_endpoints, bucket_guardrails, internet_rules]
POLICIES = [*RESOURCE_POLICIES, *STACK_POLICIES]
