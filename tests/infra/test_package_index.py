"""The package index the grading containers' pip reaches: proxpi on Fargate in the NAT (build) subnets behind an
internal ALB that only the eval hosts may reach; the eval worker learns its URL from its task definition; the eval
hosts' egress is what it was plus that one rule; the index holds no permission beyond pulling its image and logging.
"""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws
import pytest
from policy_bridge import run_stack_policies

from components import estate
from components.config import EstateConfig, from_pulumi_config
from components.state import RUNS_PREFIX
from eval_worker.package_index import DOWNLOAD_TIMEOUT_S, PACKAGE_INDEX_ENV
from policy import rules as R

TD = "aws:ecs/taskDefinition:TaskDefinition"
SG = "aws:ec2/securityGroup:SecurityGroup"
INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
EGRESS = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"


def _groups(s) -> dict[str, str]:
    """Security group id -> its tier (the key in components/security.py GROUPS, or "endpoints")."""
    return {g.id: g.inputs["tags"]["evalplane:tier"] for g in s.of(SG)}


def _rule(s, r) -> tuple:
    """(port, destination or source) of a security group rule, the peer named by its tier."""
    i = r.inputs
    assert i["ipProtocol"] == "tcp" and i["fromPort"] == i["toPort"], r.name
    if "referencedSecurityGroupId" in i:
        peer = ("group", _groups(s)[i["referencedSecurityGroupId"]])
    elif "cidrIpv4" in i:
        peer = ("cidr", i["cidrIpv4"])
    else:
        peer = ("prefix-list", i["prefixListId"])
    return i["fromPort"], peer


def _rules(s, typ: str, tier: str) -> list[tuple]:
    ids = [gid for gid, t in _groups(s).items() if t == tier]
    assert len(ids) == 1, tier
    return sorted(_rule(s, r) for r in s.of(typ) if r.inputs["securityGroupId"] == ids[0])


def _containers(s, family: str) -> list[dict]:
    (td,) = [r for r in s.of(TD) if r.inputs["family"] == family]
    return json.loads(td.inputs["containerDefinitions"])


def _tag(r, key):
    return (r.inputs.get("tags") or {}).get(key)


# ----------------------------------------------------------------------------- who reaches the index
def test_the_eval_hosts_reach_what_they_did_plus_the_package_index_only(estate_snapshot):
    """Every egress rule of the eval group, in full: anything added to it fails here."""
    s3_prefix_list = estate_snapshot.one("aws:ec2/vpcEndpoint:VpcEndpoint", "evalplane-ep-s3").outputs["prefixListId"]
    assert _rules(estate_snapshot, EGRESS, "eval") == sorted([
        (6379, ("group", "valkey")),  # Valkey
        (443, ("cidr", "10.40.0.0/16")),  # the interface endpoints (AWS APIs), in the VPC's blocks
        (443, ("cidr", "10.41.0.0/16")),
        (443, ("prefix-list", s3_prefix_list)),  # S3, through the gateway endpoint
        (80, ("group", "package_index_lb")),  # the package index: the one rule this change adds
    ])
    assert _rules(estate_snapshot, INGRESS, "eval") == []


def test_only_the_eval_group_may_reach_the_index_load_balancer(estate_snapshot):
    s = estate_snapshot
    assert _rules(s, INGRESS, "package_index_lb") == [(80, ("group", "eval"))]
    assert _rules(s, EGRESS, "package_index_lb") == [(5000, ("group", "package_index_task"))]
    assert _rules(s, INGRESS, "package_index_task") == [(5000, ("group", "package_index_lb"))]
    assert _rules(s, EGRESS, "package_index_task") == [(443, ("cidr", "0.0.0.0/0"))]  # the upstream, through NAT
    # no other group has a rule naming the index's groups (not harness, judge, head, gateway, build)
    groups = _groups(s)
    index_groups = {gid for gid, t in groups.items() if t.startswith("package_index")}
    peers = {(groups[r.inputs["securityGroupId"]], _rule(s, r)[1][1]) for r in s.of(EGRESS) + s.of(INGRESS)
             if r.inputs.get("referencedSecurityGroupId") in index_groups}
    assert peers == {("eval", "package_index_lb"), ("package_index_lb", "package_index_task"),
                     ("package_index_task", "package_index_lb")}
    lb = s.one("aws:lb/loadBalancer:LoadBalancer", "evalplane-pkg-index-alb")
    assert lb.inputs["internal"] is True and lb.inputs["loadBalancerType"] == "application"
    assert [groups[g] for g in lb.inputs["securityGroups"]] == ["package_index_lb"]
    svc = s.one("aws:ecs/service:Service", "evalplane-pkg-index-service")
    assert [groups[g] for g in svc.inputs["networkConfiguration"]["securityGroups"]] == ["package_index_task"]


def test_the_index_runs_in_the_nat_subnets_not_an_isolated_tier(estate_snapshot):
    s = estate_snapshot
    subnets = {sn.id: sn for sn in s.of("aws:ec2/subnet:Subnet")}
    tables = {rt.id: rt for rt in s.of("aws:ec2/routeTable:RouteTable")}
    table_of = {a.inputs["subnetId"]: a.inputs["routeTableId"]
                for a in s.of("aws:ec2/routeTableAssociation:RouteTableAssociation")}
    build = sorted(sn.id for sn in subnets.values() if _tag(sn, "evalplane:tier") == "build")
    svc = s.one("aws:ecs/service:Service", "evalplane-pkg-index-service")
    lb = s.one("aws:lb/loadBalancer:LoadBalancer", "evalplane-pkg-index-alb")
    for placed in (svc.inputs["networkConfiguration"]["subnets"], lb.inputs["subnets"]):
        assert sorted(placed) == build and len(build) == 3
        for sid in placed:
            assert _tag(subnets[sid], "evalplane:egress") == "nat"
            assert _tag(tables[table_of[sid]], "evalplane:egress") == "nat"  # a default route to the NAT gateway
    assert svc.inputs["launchType"] == "FARGATE" and svc.inputs["desiredCount"] == 1
    assert svc.inputs["networkConfiguration"]["assignPublicIp"] is False


# ------------------------------------------------------------------------------ what the index serves
def test_the_listener_forwards_only_reads_of_the_simple_api(estate_snapshot):
    s = estate_snapshot
    (listener,) = [x for x in s.of("aws:lb/listener:Listener") if x.name.startswith("evalplane-pkg-index")]
    lb = s.one("aws:lb/loadBalancer:LoadBalancer", "evalplane-pkg-index-alb")
    assert listener.inputs["loadBalancerArn"] == lb.outputs["arn"] and listener.inputs["port"] == 80
    (default,) = listener.inputs["defaultActions"]
    assert default["type"] == "fixed-response" and default["fixedResponse"]["statusCode"] == "404"
    (rule,) = s.of("aws:lb/listenerRule:ListenerRule")
    tg = s.one("aws:lb/targetGroup:TargetGroup", "evalplane-pkg-index-tg")
    assert rule.inputs["listenerArn"] == listener.outputs["arn"]
    assert rule.inputs["actions"] == [{"type": "forward", "targetGroupArn": tg.outputs["arn"]}]
    assert rule.inputs["conditions"] == [{"pathPattern": {"values": ["/index/*"]}},
                                         {"httpRequestMethod": {"values": ["GET", "HEAD"]}}]
    assert tg.inputs["port"] == 5000 and tg.inputs["targetType"] == "ip"
    assert lb.inputs["idleTimeout"] > DOWNLOAD_TIMEOUT_S  # a file is fetched whole before its first byte goes out


def test_proxpi_from_the_platform_repository_never_redirects_to_the_upstream(estate_snapshot):
    s = estate_snapshot
    (proxpi,) = _containers(s, "evalplane-package-index")
    assert proxpi["image"] == s.outputs["repository_urls"]["platform"] + ":package-index-latest"
    env = {e["name"]: e["value"] for e in proxpi["environment"]}
    assert float(env["PROXPI_DOWNLOAD_TIMEOUT"]) >= 300  # below it, proxpi redirects pip to the upstream
    assert env["PROXPI_CACHE_DIR"] == proxpi["mountPoints"][0]["containerPath"]
    assert "PROXPI_INDEX_URL" not in env  # proxpi's default upstream unless packageIndexUpstream is set
    assert proxpi["portMappings"] == [{"containerPort": 5000, "protocol": "tcp"}]
    assert "secrets" not in proxpi
    td = s.one(TD, "evalplane-pkg-index-task")
    assert td.inputs["requiresCompatibilities"] == ["FARGATE"] and td.inputs["networkMode"] == "awsvpc"
    assert td.inputs["ephemeralStorage"]["sizeInGib"] * 1024**3 > int(env["PROXPI_CACHE_SIZE"])


# ------------------------------------------------------------------------------ the eval worker's side
def test_the_eval_worker_gets_the_index_url_and_no_other_task_does(estate_snapshot):
    s = estate_snapshot
    lb = s.one("aws:lb/loadBalancer:LoadBalancer", "evalplane-pkg-index-alb")
    url = f"http://{lb.outputs['dnsName']}/index/"
    assert s.outputs["package_index_url"] == url and "package_index_url" in estate.OUTPUT_KEYS
    (worker,) = _containers(s, "evalplane-eval-worker")
    assert {"name": PACKAGE_INDEX_ENV, "value": url} in worker["environment"]
    assert PACKAGE_INDEX_ENV == "EVALPLANE_PACKAGE_INDEX"
    for family in ("evalplane-harness", "evalplane-judge", "evalplane-gateway", "evalplane-package-index"):
        for c in _containers(s, family):
            assert PACKAGE_INDEX_ENV not in {e["name"] for e in c.get("environment", [])}, family
            assert url not in json.dumps(c), family


# ------------------------------------------------------------------------------------ permissions
def test_the_index_holds_no_permission_beyond_pulling_its_image_and_logging(estate_snapshot):
    s = estate_snapshot
    roles = [r for r in s.of("aws:iam/role:Role") if _tag(r, "evalplane:tier") == "package-index"]
    assert [r.name for r in roles] == ["evalplane-pkg-index-exec-role"]  # no task role
    (role,) = roles
    assert json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]["Principal"] == {
        "Service": "ecs-tasks.amazonaws.com"}
    td = s.one(TD, "evalplane-pkg-index-task")
    assert td.inputs["executionRoleArn"] == role.outputs["arn"] and "taskRoleArn" not in td.inputs
    (policy,) = [p for p in s.of("aws:iam/rolePolicy:RolePolicy") if p.inputs["role"] == role.id]
    assert policy.inputs["name"] == "package-index-exec"
    platform = s.one("aws:ecr/repository:Repository", "evalplane-state-platform").outputs["arn"]
    logs = s.one("aws:cloudwatch/logGroup:LogGroup", "evalplane-pkg-index-logs")
    assert logs.inputs["name"] == "/evalplane/package-index"
    statements = [(st["Effect"], sorted(st["Action"]), st["Resource"])
                  for st in json.loads(policy.inputs["policy"])["Statement"]]
    assert sorted(statements) == sorted([
        ("Allow", ["ecr:GetAuthorizationToken"], "*"),
        ("Allow", ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"], [platform]),
        ("Allow", ["logs:CreateLogStream", "logs:PutLogEvents"], [logs.outputs["arn"] + ":*"]),
    ])
    assert R.WILDCARD_ALLOWLIST["package-index-exec"].keys() == {"ecr:GetAuthorizationToken"}
    assert RUNS_PREFIX not in policy.inputs["policy"]


# ----------------------------------------------------------------------------------------- config
def test_stack_config_drives_the_index(pulumi_mocks):
    pulumi.runtime.set_all_config({
        "evalplane:packageIndexImageTag": "package-index-1.2.3",
        "evalplane:packageIndexReplicas": "2",
        "evalplane:packageIndexUpstream": "https://mirror.example.com/simple/",
    })
    cfg = from_pulumi_config()
    assert (cfg.package_index_image_tag, cfg.package_index_replicas) == ("package-index-1.2.3", 2)

    @pulumi.runtime.test
    def build():
        return pulumi.Output.from_input(estate.build(cfg))

    build()
    m = pulumi_mocks.mocks
    assert m.one("aws:ecs/service:Service", "evalplane-pkg-index-service").inputs["desiredCount"] == 2
    (proxpi,) = json.loads(m.one(TD, "evalplane-pkg-index-task").inputs["containerDefinitions"])
    assert proxpi["image"].endswith("/evalplane/platform:package-index-1.2.3")
    assert {"name": "PROXPI_INDEX_URL", "value": "https://mirror.example.com/simple/"} in proxpi["environment"]


def test_invalid_index_config_is_rejected():
    with pytest.raises(ValueError, match="packageIndexUpstream"):
        EstateConfig(package_index_upstream="http://mirror.example.com/simple/")  # the tasks may open HTTPS only
    with pytest.raises(ValueError, match="packageIndexReplicas"):
        EstateConfig(package_index_replicas=-1)


# ----------------------------------------------------------------------------------------- policy
def test_the_internet_rules_policy_admits_the_nat_tiers_only(estate_snapshot, pulumi_mocks):
    assert run_stack_policies([R.internet_rules], estate_snapshot.created) == []

    @pulumi.runtime.test
    def build():
        out = estate.build(EstateConfig())
        # the eval hosts opened to the internet, and an ingress from it on the index's load balancer
        aws.vpc.SecurityGroupEgressRule("rogue-eval-out", security_group_id="evalplane-sg-eval-id",
                                        ip_protocol="tcp", from_port=80, to_port=80, cidr_ipv4="0.0.0.0/0")
        aws.vpc.SecurityGroupIngressRule("rogue-lb-in", security_group_id="evalplane-sg-package-index-lb-id",
                                         ip_protocol="tcp", from_port=80, to_port=80, cidr_ipv4="0.0.0.0/0")
        aws.ec2.SecurityGroup("rogue-sg", vpc_id="v", tags={"evalplane:tier": "harness"},
                              egress=[{"protocol": "-1", "from_port": 0, "to_port": 0, "cidr_blocks": ["0.0.0.0/0"]}])
        return pulumi.Output.from_input(out)

    build()
    pulumi_mocks.attach_urns()
    found = run_stack_policies([R.internet_rules], pulumi_mocks.mocks.created)
    assert sorted(urn.rsplit("::", 1)[-1] for _, urn, _ in found) == ["rogue-eval-out", "rogue-lb-in", "rogue-sg"]
    assert "evalplane-sg-eval" in next(msg for _, urn, msg in found if urn.endswith("rogue-eval-out"))
