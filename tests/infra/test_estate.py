"""The estate's rules, asserted on what the Pulumi mocks recorded for one `estate.build()`."""

from __future__ import annotations

import ipaddress
import json

import pulumi
import pytest
from infra_support import Snapshot

from components import estate
from components.config import (
    EstateConfig,
    from_pulumi_config,
    harness_capacity,
    harness_prefixlen,
    harness_subnets,
    tier_subnets,
    usable,
)
from components.network import REQUIRED_INTERFACE_ENDPOINTS

DEFAULTS = ("0.0.0.0/0", "::/0")
TARGET_TASKS = 20_000


def _tag(r, key):
    return (r.inputs.get("tags") or {}).get(key)


def _harness_subnets(s: Snapshot):
    return [r for r in s.of("aws:ec2/subnet:Subnet") if _tag(r, "evalplane:tier") == "harness"]


def _tables_of(s: Snapshot, subnet_ids: set[str]) -> set[str]:
    return {
        a.inputs["routeTableId"]
        for a in s.of("aws:ec2/routeTableAssociation:RouteTableAssociation")
        if a.inputs["subnetId"] in subnet_ids
    }


# ------------------------------------------------------------------------------------- network
def test_harness_route_tables_have_no_default_route(estate_snapshot):
    s = estate_snapshot
    harness = _harness_subnets(s)
    assert len(harness) >= 3
    ids = {r.id for r in harness}
    tables = _tables_of(s, ids)
    assert tables, "harness subnets must have an explicit route table"
    assert len(_tables_of(s, ids)) == 1 and all(
        any(a.inputs["subnetId"] == sid for a in s.of("aws:ec2/routeTableAssociation:RouteTableAssociation"))
        for sid in ids
    )
    for rt in s.of("aws:ec2/routeTable:RouteTable"):
        if rt.id in tables:
            for route in rt.inputs.get("routes") or []:
                assert route.get("cidrBlock") not in DEFAULTS and route.get("ipv6CidrBlock") not in DEFAULTS
    for route in s.of("aws:ec2/route:Route"):
        if route.inputs["routeTableId"] in tables:
            assert route.inputs.get("destinationCidrBlock") not in DEFAULTS
            assert route.inputs.get("destinationIpv6CidrBlock") not in DEFAULTS


def test_default_routes_exist_only_for_nat_and_igw_tables(estate_snapshot):
    s = estate_snapshot
    tables = {rt.id: rt for rt in s.of("aws:ec2/routeTable:RouteTable")}
    defaults = [r for r in s.of("aws:ec2/route:Route") if r.inputs.get("destinationCidrBlock") in DEFAULTS]
    assert defaults
    for r in defaults:
        egress = _tag(tables[r.inputs["routeTableId"]], "evalplane:egress")
        assert egress in ("nat", "igw")
        assert ("natGatewayId" in r.inputs) == (egress == "nat")
        assert ("gatewayId" in r.inputs) == (egress == "igw")
    # Only the gateway and build tiers reach NAT tables; only the public tier reaches the IGW table.
    egress_tables = {i for i, rt in tables.items() if _tag(rt, "evalplane:egress") != "none"}
    subnets = {sn.id: sn for sn in s.of("aws:ec2/subnet:Subnet")}
    for a in s.of("aws:ec2/routeTableAssociation:RouteTableAssociation"):
        tier = _tag(subnets[a.inputs["subnetId"]], "evalplane:tier")
        if a.inputs["routeTableId"] in egress_tables:
            assert tier in ("gateway", "build", "public"), tier
    igws = s.of("aws:ec2/internetGateway:InternetGateway")
    assert len(igws) == 1
    for nat in s.of("aws:ec2/natGateway:NatGateway"):
        assert _tag(subnets[nat.inputs["subnetId"]], "evalplane:tier") == "public"


def test_separate_subnets_per_tier_across_three_azs(estate_snapshot):
    tiers: dict[str, list] = {}
    for sn in estate_snapshot.of("aws:ec2/subnet:Subnet"):
        tiers.setdefault(_tag(sn, "evalplane:tier"), []).append(sn)
    for tier in ("harness", "gateway", "eval", "head", "build", "data", "endpoints", "public"):
        assert len(tiers[tier]) == 3, tier
        assert len({sn.inputs["availabilityZone"] for sn in tiers[tier]}) == 3
    cidrs = [ipaddress.ip_network(sn.inputs["cidrBlock"]) for sn in estate_snapshot.of("aws:ec2/subnet:Subnet")]
    for i, a in enumerate(cidrs):
        for b in cidrs[i + 1 :]:
            assert not a.overlaps(b), (a, b)


def test_vpc_endpoints_present_with_private_dns(estate_snapshot):
    eps = estate_snapshot.of("aws:ec2/vpcEndpoint:VpcEndpoint")
    by_service = {e.inputs["serviceName"].rsplit(".", 1)[-1] if "ecr" not in e.inputs["serviceName"]
                  else e.inputs["serviceName"].split("us-east-1.")[-1]: e for e in eps}
    s3 = by_service["s3"]
    assert s3.inputs["vpcEndpointType"] == "Gateway"
    isolated_tables = {
        rt.id for rt in estate_snapshot.of("aws:ec2/routeTable:RouteTable") if _tag(rt, "evalplane:egress") == "none"
    }
    harness_tables = _tables_of(estate_snapshot, {r.id for r in _harness_subnets(estate_snapshot)})
    assert harness_tables <= set(s3.inputs["routeTableIds"]) == isolated_tables
    for svc in REQUIRED_INTERFACE_ENDPOINTS:
        e = by_service[svc]
        assert e.inputs["serviceName"] == f"com.amazonaws.us-east-1.{svc}"
        assert e.inputs["vpcEndpointType"] == "Interface"
        assert e.inputs["privateDnsEnabled"] is True
        assert len(e.inputs["subnetIds"]) == 3 and e.inputs["securityGroupIds"]
    vpc = estate_snapshot.of("aws:ec2/vpc:Vpc")[0]
    assert vpc.inputs["enableDnsHostnames"] is True and vpc.inputs["enableDnsSupport"] is True


def test_address_headroom_for_20k_tasks_from_recorded_cidrs(estate_snapshot):
    cidrs = [sn.inputs["cidrBlock"] for sn in _harness_subnets(estate_snapshot)]
    capacity = sum(ipaddress.ip_network(c).num_addresses - 5 for c in cidrs)
    assert capacity >= TARGET_TASKS * 1.5, capacity  # the configured headroom factor
    # every AZ alone holds its share with headroom, so losing balance across AZs is not fatal
    per_az = min(ipaddress.ip_network(c).num_addresses - 5 for c in cidrs)
    assert per_az * 3 >= TARGET_TASKS * 1.5
    assert estate_snapshot.outputs["harness_capacity"] == capacity
    assert estate_snapshot.outputs["harness_subnet_cidrs"] == cidrs
    # the harness block is a secondary CIDR associated with the VPC (one VPC block is at most a /16)
    assoc = estate_snapshot.of("aws:ec2/vpcIpv4CidrBlockAssociation:VpcIpv4CidrBlockAssociation")
    assert [a.inputs["cidrBlock"] for a in assoc] == ["10.41.0.0/16"]
    assert all(ipaddress.ip_network(c).subnet_of(ipaddress.ip_network("10.41.0.0/16")) for c in cidrs)


def test_subnet_sizing_arithmetic():
    assert usable(18) == 16_379 and usable(19) == 8_187
    assert harness_prefixlen(20_000, 1.5, 3) == 18  # 10,000 per AZ > a /19
    assert harness_prefixlen(20_000, 1.0, 4) == 19  # 5,000 per AZ fits a /19
    assert harness_prefixlen(500, 1.5, 3) == 24  # 250 per AZ: a /24 holds 251
    cfg = EstateConfig()
    assert harness_capacity(harness_subnets(cfg)) == 3 * 16_379
    with pytest.raises(ValueError):
        harness_subnets(EstateConfig(harness_cidr="10.41.0.0/17"))  # two /18s only
    with pytest.raises(ValueError):
        harness_prefixlen(200_000, 1.5, 2)  # more than a /16 per AZ
    six = tier_subnets(EstateConfig(az_count=6))
    assert all(len(v) == 6 for v in six.values())


# -------------------------------------------------------------------------------------- compute
def test_eval_task_definition_requires_ec2(estate_snapshot):
    tds = {r.inputs["family"]: r for r in estate_snapshot.of("aws:ecs/taskDefinition:TaskDefinition")}
    assert set(tds) == {"evalplane-harness", "evalplane-judge", "evalplane-eval-worker", "evalplane-gateway",
                        "evalplane-package-index"}
    ev = tds["evalplane-eval-worker"]
    assert ev.inputs["requiresCompatibilities"] == ["EC2"]
    assert any(v["hostPath"] == "/var/run/docker.sock" for v in ev.inputs["volumes"])
    for fam in ("evalplane-harness", "evalplane-judge", "evalplane-gateway", "evalplane-package-index"):
        assert tds[fam].inputs["requiresCompatibilities"] == ["FARGATE"]
        assert tds[fam].inputs["networkMode"] == "awsvpc"


def test_no_public_ip_anywhere(estate_snapshot):
    s = estate_snapshot
    services = s.of("aws:ecs/service:Service")
    assert services
    for svc in services:
        nc = svc.inputs.get("networkConfiguration")
        assert nc is None or nc.get("assignPublicIp") in (False, None)
    for sn in s.of("aws:ec2/subnet:Subnet"):
        assert not sn.inputs.get("mapPublicIpOnLaunch")
    for lt in s.of("aws:ec2/launchTemplate:LaunchTemplate"):
        for ni in lt.inputs.get("networkInterfaces") or []:
            assert ni.get("associatePublicIpAddress") in ("false", False)
        assert lt.inputs["metadataOptions"]["httpTokens"] == "required"
    for inst in s.of("aws:ec2/instance:Instance"):
        assert inst.inputs.get("associatePublicIpAddress") is False
    # Elastic IPs exist only for NAT gateways
    eips = {e.id for e in s.of("aws:ec2/eip:Eip")}
    assert eips == {n.inputs["allocationId"] for n in s.of("aws:ec2/natGateway:NatGateway")}


def test_no_container_on_an_ec2_tier_reaches_the_instance_metadata_service(estate_snapshot):
    """IMDSv2 only, and its token answer dies after one hop: a container (the eval hosts' grading containers, the
    builders' image builds) is one hop further, so it never gets the instance role's credentials."""
    lts = {lt.name: lt for lt in estate_snapshot.of("aws:ec2/launchTemplate:LaunchTemplate")}
    assert set(lts) == {"evalplane-eval-lt", "evalplane-build-lt", "evalplane-head-lt"}
    for lt in lts.values():
        assert lt.inputs["metadataOptions"] == {
            "httpTokens": "required", "httpEndpoint": "enabled", "httpPutResponseHopLimit": 1}, lt.name


def test_every_autoscaling_group_has_min_zero(estate_snapshot):
    asgs = estate_snapshot.of("aws:autoscaling/group:Group")
    assert {a.inputs["name"] for a in asgs} == {"evalplane-eval", "evalplane-build"}
    for a in asgs:
        assert a.inputs["minSize"] == 0
        assert a.inputs.get("desiredCapacity", 0) == 0


def test_eval_capacity_provider_on_the_asg(estate_snapshot):
    cp = estate_snapshot.of("aws:ecs/capacityProvider:CapacityProvider")[0]
    asg = estate_snapshot.one("aws:autoscaling/group:Group", "evalplane-eval-asg")
    assert cp.inputs["autoScalingGroupProvider"]["autoScalingGroupArn"] == asg.outputs["arn"]
    lt = estate_snapshot.one("aws:ec2/launchTemplate:LaunchTemplate", "evalplane-eval-lt")
    assert lt.inputs["blockDeviceMappings"][0]["ebs"]["volumeSize"] == 500


# ------------------------------------------------------------------------------------ encryption
def test_encryption_everywhere(estate_snapshot):
    s = estate_snapshot
    key_arn = s.of("aws:kms/key:Key")[0].outputs["arn"]
    (aurora,) = s.of("aws:rds/cluster:Cluster")
    assert aurora.inputs["storageEncrypted"] is True and aurora.inputs["kmsKeyId"] == key_arn
    assert aurora.inputs["manageMasterUserPassword"] is True and "masterPassword" not in aurora.inputs
    assert aurora.inputs["engine"] == "aurora-postgresql"
    assert aurora.inputs["serverlessv2ScalingConfiguration"]["minCapacity"] == 0
    assert s.of("aws:rds/clusterInstance:ClusterInstance")[0].inputs["instanceClass"] == "db.serverless"
    (valkey,) = s.of("aws:elasticache/replicationGroup:ReplicationGroup")
    assert valkey.inputs["engine"] == "valkey"
    assert valkey.inputs["transitEncryptionEnabled"] is True and valkey.inputs["atRestEncryptionEnabled"] is True
    (sse,) = s.of("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration")
    rule = sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]
    assert rule == {"sseAlgorithm": "aws:kms", "kmsMasterKeyId": key_arn}
    secrets = s.of("aws:secretsmanager/secret:Secret")
    # the gateway's two provider keys, master key and database role; Valkey's dispatcher, harness and gateway users;
    # the verdict key (runs' own key secrets and judge passes' are the dispatcher's, made per run and per pass)
    assert len(secrets) == 8 and all(x.inputs["kmsKeyId"] == key_arn for x in secrets)
    for lt in s.of("aws:ec2/launchTemplate:LaunchTemplate"):
        assert all(bd["ebs"]["encrypted"] == "true" for bd in lt.inputs["blockDeviceMappings"])


def test_bucket_versioning_public_access_block_and_lifecycle(estate_snapshot):
    s = estate_snapshot
    (bucket,) = s.of("aws:s3/bucket:Bucket")
    for typ in ("bucketVersioning:BucketVersioning", "bucketPublicAccessBlock:BucketPublicAccessBlock",
                "bucketLifecycleConfiguration:BucketLifecycleConfiguration"):
        (r,) = s.of(f"aws:s3/{typ}")
        assert r.inputs["bucket"] == bucket.id
    assert s.of("aws:s3/bucketVersioning:BucketVersioning")[0].inputs["versioningConfiguration"]["status"] == "Enabled"
    pab = s.of("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock")[0].inputs
    assert all(pab[k] is True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets"))
    rules = {r["id"]: r for r in s.of("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")[0].inputs["rules"]}
    assert {"logs", "trajectories"} <= set(rules)
    assert rules["logs"]["expiration"]["days"] == 90


def test_ecr_repositories_immutable_and_scanned(estate_snapshot):
    repos = {r.inputs["name"]: r for r in estate_snapshot.of("aws:ecr/repository:Repository")}
    assert {"evalplane/harness-base", "evalplane/eval-images", "evalplane/task-images"} <= set(repos)
    for r in repos.values():
        assert r.inputs["imageTagMutability"] == "IMMUTABLE"
        assert r.inputs["imageScanningConfiguration"]["scanOnPush"] is True


def test_task_images_repository_belongs_to_the_build_tier(estate_snapshot):
    s = estate_snapshot
    repo = s.one("aws:ecr/repository:Repository", "evalplane-build-task-images")
    assert repo.urn.split("::")[2].startswith("evalplane:build:BuildTier$")
    assert s.outputs["task_images_repository_url"] == repo.outputs["repositoryUrl"]
    (lifecycle,) = s.of("aws:ecr/lifecyclePolicy:LifecyclePolicy")
    assert lifecycle.inputs["repository"] == repo.outputs["name"]
    (rule,) = json.loads(lifecycle.inputs["policy"])["rules"]
    assert rule["action"] == {"type": "expire"} and rule["selection"]["countType"] == "sinceImagePushed"
    assert rule["selection"]["countNumber"] == 90


# ---------------------------------------------------------------------------------- gateway tier
def test_gateway_two_replicas_behind_internal_lb_reachable_only_from_tasks(estate_snapshot):
    s = estate_snapshot
    lb = s.one("aws:lb/loadBalancer:LoadBalancer", "evalplane-gateway-alb")
    assert lb.inputs["internal"] is True
    svc = s.one("aws:ecs/service:Service", "evalplane-gateway-service")
    assert svc.inputs["desiredCount"] == 2 and svc.inputs["launchType"] == "FARGATE"
    groups = {g.id: g.name for g in s.of("aws:ec2/securityGroup:SecurityGroup")}
    lb_sg = lb.inputs["securityGroups"][0]
    ingress = [r for r in s.of("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
               if r.inputs["securityGroupId"] == lb_sg]
    sources = {groups[r.inputs["referencedSecurityGroupId"]] for r in ingress}
    assert sources == {"evalplane-sg-harness", "evalplane-sg-judge", "evalplane-sg-head"}
    assert all("cidrIpv4" not in r.inputs for r in ingress)
    td = json.loads(s.one("aws:ecs/taskDefinition:TaskDefinition", "evalplane-gateway-task").inputs["containerDefinitions"])
    env = {e["name"]: e["value"] for e in td[0]["environment"]}
    assert env["LITELLM_CONFIG_BUCKET_OBJECT_KEY"] == "config/gateway/litellm.yaml"
    secrets = {x["name"] for x in td[0]["secrets"]}
    assert "LITELLM_MASTER_KEY" in secrets and not {"ANTHROPIC_API_KEY", "OPENAI_API_KEY"} & secrets


def test_no_ingress_from_the_internet(estate_snapshot):
    for r in estate_snapshot.of("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"):
        assert r.inputs.get("cidrIpv4") not in DEFAULTS and r.inputs.get("cidrIpv6") != "::/0"
    open_egress = {
        r.inputs["securityGroupId"]
        for r in estate_snapshot.of("aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule")
        if r.inputs.get("cidrIpv4") == "0.0.0.0/0"
    }
    assert open_egress == {"evalplane-sg-gateway-task-id", "evalplane-sg-build-id", "evalplane-sg-package-index-task-id"}


# ---------------------------------------------------------------------------- guard and budget
def test_guard_schedules_lambda_and_budget(estate_snapshot):
    s = estate_snapshot
    (fn,) = s.of("aws:lambda/function:Function")
    env = fn.inputs["environment"]["variables"]
    assert env["ASGS"] == "evalplane-eval,evalplane-build"
    assert env["INSTANCES"] == "evalplane-head-instance-id"
    assert json.loads(env["SERVICES"])[1][1] == "evalplane-eval-worker"
    schedules = {x.inputs["name"]: x for x in s.of("aws:scheduler/schedule:Schedule")}
    assert schedules["evalplane-guard-nightly"].inputs["scheduleExpression"] == "cron(0 2 * * ? *)"
    assert json.loads(schedules["evalplane-guard-deadline"].inputs["target"]["input"]) == {"mode": "deadline"}
    (budget,) = s.of("aws:budgets/budget:Budget")
    assert budget.inputs["limitAmount"] == "1000.00" and budget.inputs["timeUnit"] == "MONTHLY"
    assert len(budget.inputs["notifications"]) == 4


# ------------------------------------------------------------------------ component discipline
def test_every_resource_is_parented_to_a_component_and_prefixed(estate_snapshot):
    customs = estate_snapshot.custom()
    components = [r for r in estate_snapshot.created if not r.custom]
    assert len(components) == 11
    assert all(r.typ.startswith("evalplane:") for r in components)
    for r in customs:
        assert r.urn, r.name
        qualified = r.urn.split("::")[2]
        parent_type = qualified.split("$")[0]
        assert parent_type.startswith("evalplane:"), r.urn  # parent=self on every child
        owners = [c for c in components if c.typ == parent_type and r.name.startswith(c.name)]
        assert owners, f"{r.name} is not prefixed with its component's name ({parent_type})"


def test_outputs_for_the_dispatcher(estate_snapshot):
    out = estate_snapshot.outputs
    assert set(out) == set(estate.OUTPUT_KEYS)
    assert out["cluster_arn"].endswith(":cluster/evalplane-harness")
    assert out["harness_task_definition_arn"].endswith("task-definition/evalplane-harness:1")
    assert out["eval_task_definition_arn"].endswith("task-definition/evalplane-eval-worker:1")
    assert out["gateway_url"].startswith("http://internal-")
    assert len(out["harness_subnet_ids"]) == 3 and len(out["eval_subnet_ids"]) == 3
    assert out["queue_prefix"] == "evalplane-" and out["runs_prefix"] == "runs/"
    assert json.loads(json.dumps(out)) == out  # `pulumi stack output --json` shape


def test_stack_config_drives_the_build(pulumi_mocks):
    pulumi.runtime.set_all_config(
        {
            "evalplane:azCount": "4",
            "evalplane:targetTasks": "8000",
            "evalplane:headroom": "2.0",
            "evalplane:natPerAz": "true",
            "evalplane:harnessEphemeralGb": "40",
            "evalplane:taskImageExpiryDays": "30",
            "evalplane:monthlyBudgetUsd": "250",
            "evalplane:budgetEmails": '["ops@example.com"]',
            "evalplane:gatewayProviders": '["ANTHROPIC_API_KEY"]',
        }
    )
    cfg = from_pulumi_config()
    assert cfg.az_count == 4 and cfg.nat_per_az and cfg.budget_emails == ("ops@example.com",)

    @pulumi.runtime.test
    def build():
        return pulumi.Output.from_input(estate.build(cfg))

    build()
    m = pulumi_mocks.mocks
    harness = [r for r in m.of("aws:ec2/subnet:Subnet") if _tag(r, "evalplane:tier") == "harness"]
    assert len(harness) == 4
    assert {r.inputs["cidrBlock"].split("/")[1] for r in harness} == {"20"}  # 4,000 per AZ -> /20
    assert len(m.of("aws:ec2/natGateway:NatGateway")) == 4
    assert len(m.of("aws:sns/topicSubscription:TopicSubscription")) == 1
    assert m.of("aws:budgets/budget:Budget")[0].inputs["limitAmount"] == "250.00"
    td = m.one("aws:ecs/taskDefinition:TaskDefinition", "evalplane-harness-task")
    assert td.inputs["ephemeralStorage"]["sizeInGib"] == 40
    (lifecycle,) = m.of("aws:ecr/lifecyclePolicy:LifecyclePolicy")
    assert json.loads(lifecycle.inputs["policy"])["rules"][0]["selection"]["countNumber"] == 30


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError):
        EstateConfig(az_count=1)
    with pytest.raises(ValueError):
        EstateConfig(headroom=0.5)
    with pytest.raises(ValueError):
        tier_subnets(EstateConfig(vpc_cidr="10.40.0.0/20"))
    with pytest.raises(ValueError, match="harnessEphemeralGb"):
        EstateConfig(harness_ephemeral_gb=20)  # below Fargate's configurable minimum
    with pytest.raises(ValueError, match="taskImageExpiryDays"):
        EstateConfig(task_image_expiry_days=0)


def test_every_nested_input_reached_the_provider_in_wire_form(estate_snapshot):
    """A mistyped dict key (e.g. `assign_public_ipp`) would reach the engine untranslated, in snake_case."""
    bad: list[str] = []

    def walk(v, path):
        if isinstance(v, dict):
            for k, x in v.items():
                if "_" in k and not {"tags", "variables"} & set(path):
                    bad.append(f"{'/'.join(path)}/{k}")
                walk(x, [*path, k])
        elif isinstance(v, list):
            for x in v:
                walk(x, path)

    for r in estate_snapshot.custom():
        walk(r.inputs, [r.name])
    assert bad == []


def test_task_security_groups_take_no_inbound_traffic(estate_snapshot):
    ingress_targets = {
        r.inputs["securityGroupId"] for r in estate_snapshot.of("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
    }
    for tier in ("harness", "judge", "eval", "head", "build"):
        assert f"evalplane-sg-{tier}-id" not in ingress_targets, tier


def test_a_generated_password_keeps_its_first_value_on_later_ups(estate_snapshot):
    """getRandomPassword answers anew on every `pulumi up`: each resource holding one (a Valkey user, a secret's
    value: the verdict key, the gateway's master key and database role) ignores later answers."""
    holding = [r for r in estate_snapshot.custom() if "mockpassword" in json.dumps(r.inputs, default=str)]
    kinds = {r.typ for r in holding}
    assert kinds == {"aws:elasticache/user:User", "aws:secretsmanager/secretVersion:SecretVersion"}, kinds
    assert len(holding) >= 7
    for r in holding:
        field = "authenticationMode" if r.typ == "aws:elasticache/user:User" else "secretString"
        assert field in r.ignore_changes, (r.name, r.ignore_changes)
