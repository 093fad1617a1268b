"""Network: the VPC, per-tier subnets, route tables, NAT/IGW only where needed, VPC endpoints, security groups."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.common import ANYWHERE, EGRESS_TAG, child, region, tags
from components.config import EstateConfig, harness_capacity, harness_subnets, tier_subnets

REQUIRED_INTERFACE_ENDPOINTS = ("sqs", "ecr.api", "ecr.dkr", "logs", "secretsmanager", "sts")
ISOLATED_TIERS = ("harness", "eval", "head", "data", "endpoints")  # route tables with no default route
NAT_TIERS = ("gateway", "build")  # reach the internet through NAT: providers, official images


@dataclass(frozen=True)
class NetworkArgs:
    prefix: str
    az_count: int
    vpc_cidr: str
    harness_cidr: str
    harness_subnet_cidrs: tuple[str, ...]
    tier_subnet_cidrs: dict[str, list[str]]
    nat_per_az: bool = False
    interface_endpoints: tuple[str, ...] = REQUIRED_INTERFACE_ENDPOINTS

    @staticmethod
    def from_config(cfg: EstateConfig) -> NetworkArgs:
        eps = tuple(dict.fromkeys(REQUIRED_INTERFACE_ENDPOINTS + tuple(cfg.extra_endpoints)))
        return NetworkArgs(
            prefix=cfg.prefix,
            az_count=cfg.az_count,
            vpc_cidr=cfg.vpc_cidr,
            harness_cidr=cfg.harness_cidr,
            harness_subnet_cidrs=tuple(harness_subnets(cfg)),
            tier_subnet_cidrs=tier_subnets(cfg),
            nat_per_az=cfg.nat_per_az,
            interface_endpoints=eps,
        )


class Network(pulumi.ComponentResource):
    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:net:Network", name, None, opts)
        p = args.prefix
        azs = aws.get_availability_zones_output(state="available")

        def az(i: int) -> pulumi.Output[str]:
            return azs.names.apply(lambda names: names[i])

        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.vpc_cidr,
            enable_dns_hostnames=True,  # interface endpoints with private DNS need both
            enable_dns_support=True,
            tags=tags(p, "network", Name=f"{p}-vpc"),
            opts=child(self),
        )
        # The harness address space is a secondary /16: AWS caps one VPC CIDR block at /16.
        harness_block = aws.ec2.VpcIpv4CidrBlockAssociation(
            f"{name}-harness-cidr", vpc_id=self.vpc.id, cidr_block=args.harness_cidr, opts=child(self)
        )

        # ---- subnets
        self.subnets: dict[str, list[aws.ec2.Subnet]] = {"harness": []}
        for i, cidr in enumerate(args.harness_subnet_cidrs):
            self.subnets["harness"].append(
                aws.ec2.Subnet(
                    f"{name}-harness-{i}",
                    vpc_id=self.vpc.id,
                    cidr_block=cidr,
                    availability_zone=az(i),
                    map_public_ip_on_launch=False,
                    tags=tags(p, "harness", **{EGRESS_TAG: "none", "Name": f"{p}-harness-{i}"}),
                    opts=child(self, depends_on=[harness_block]),
                )
            )
        for tier, cidrs in args.tier_subnet_cidrs.items():
            egress = "igw" if tier == "public" else ("nat" if tier in NAT_TIERS else "none")
            self.subnets[tier] = [
                aws.ec2.Subnet(
                    f"{name}-{tier}-{i}",
                    vpc_id=self.vpc.id,
                    cidr_block=cidr,
                    availability_zone=az(i),
                    map_public_ip_on_launch=False,  # NAT gateways get Elastic IPs; nothing else is public
                    tags=tags(p, tier, **{EGRESS_TAG: egress, "Name": f"{p}-{tier}-{i}"}),
                    opts=child(self),
                )
                for i, cidr in enumerate(cidrs)
            ]

        # ---- internet: an IGW only for the NAT gateways' public subnets
        self.igw = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=self.vpc.id, tags=tags(p, "public", Name=f"{p}-igw"), opts=child(self)
        )
        public_rt = aws.ec2.RouteTable(
            f"{name}-public-rt",
            vpc_id=self.vpc.id,
            tags=tags(p, "public", **{EGRESS_TAG: "igw", "Name": f"{p}-public"}),
            opts=child(self),
        )
        aws.ec2.Route(
            f"{name}-public-default",
            route_table_id=public_rt.id,
            destination_cidr_block=ANYWHERE,
            gateway_id=self.igw.id,
            opts=child(self),
        )
        for i, sn in enumerate(self.subnets["public"]):
            aws.ec2.RouteTableAssociation(
                f"{name}-public-rta-{i}", subnet_id=sn.id, route_table_id=public_rt.id, opts=child(self)
            )

        nat_count = args.az_count if args.nat_per_az else 1
        self.nat_gateways: list[aws.ec2.NatGateway] = []
        nat_rts: list[aws.ec2.RouteTable] = []
        for i in range(nat_count):
            eip = aws.ec2.Eip(f"{name}-nat-eip-{i}", domain="vpc", tags=tags(p, "public"), opts=child(self))
            nat = aws.ec2.NatGateway(
                f"{name}-nat-{i}",
                allocation_id=eip.id,
                subnet_id=self.subnets["public"][i].id,
                tags=tags(p, "public", Name=f"{p}-nat-{i}"),
                opts=child(self, depends_on=[self.igw]),
            )
            self.nat_gateways.append(nat)
            rt = aws.ec2.RouteTable(
                f"{name}-nat-rt-{i}",
                vpc_id=self.vpc.id,
                tags=tags(p, "egress", **{EGRESS_TAG: "nat", "Name": f"{p}-nat-{i}"}),
                opts=child(self),
            )
            aws.ec2.Route(
                f"{name}-nat-default-{i}",
                route_table_id=rt.id,
                destination_cidr_block=ANYWHERE,
                nat_gateway_id=nat.id,
                opts=child(self),
            )
            nat_rts.append(rt)
        for tier in NAT_TIERS:
            for i, sn in enumerate(self.subnets[tier]):
                aws.ec2.RouteTableAssociation(
                    f"{name}-{tier}-rta-{i}",
                    subnet_id=sn.id,
                    route_table_id=nat_rts[i % nat_count].id,
                    opts=child(self),
                )

        # ---- isolated tiers: route tables with only the implicit local route (plus the S3 gateway endpoint)
        self.isolated_route_tables: dict[str, aws.ec2.RouteTable] = {}
        for tier in ISOLATED_TIERS:
            rt = aws.ec2.RouteTable(
                f"{name}-{tier}-rt",
                vpc_id=self.vpc.id,
                routes=[],  # authoritative: no 0.0.0.0/0, no ::/0
                tags=tags(p, tier, **{EGRESS_TAG: "none", "Name": f"{p}-{tier}"}),
                opts=child(self),
            )
            self.isolated_route_tables[tier] = rt
            for i, sn in enumerate(self.subnets[tier]):
                aws.ec2.RouteTableAssociation(
                    f"{name}-{tier}-rta-{i}", subnet_id=sn.id, route_table_id=rt.id, opts=child(self)
                )

        # ---- VPC endpoints
        rgn = region()
        self.vpc_cidrs = [args.vpc_cidr, args.harness_cidr]
        self.endpoint_sg = aws.ec2.SecurityGroup(
            f"{name}-endpoints-sg",
            vpc_id=self.vpc.id,
            description="VPC interface endpoints: HTTPS from inside the VPC",
            tags=tags(p, "endpoints"),
            opts=child(self),
        )
        for j, cidr in enumerate(self.vpc_cidrs):
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-endpoints-in-{j}",
                security_group_id=self.endpoint_sg.id,
                ip_protocol="tcp",
                from_port=443,
                to_port=443,
                cidr_ipv4=cidr,
                opts=child(self),
            )
        self.s3_endpoint = aws.ec2.VpcEndpoint(
            f"{name}-ep-s3",
            vpc_id=self.vpc.id,
            service_name=pulumi.Output.concat("com.amazonaws.", rgn, ".s3"),
            vpc_endpoint_type="Gateway",
            route_table_ids=[rt.id for rt in self.isolated_route_tables.values()],
            tags=tags(p, "endpoints", Name=f"{p}-s3"),
            opts=child(self),
        )
        self.interface_endpoints: dict[str, aws.ec2.VpcEndpoint] = {}
        for svc in args.interface_endpoints:
            self.interface_endpoints[svc] = aws.ec2.VpcEndpoint(
                f"{name}-ep-{svc.replace('.', '-')}",
                vpc_id=self.vpc.id,
                service_name=pulumi.Output.concat("com.amazonaws.", rgn, f".{svc}"),
                vpc_endpoint_type="Interface",
                private_dns_enabled=True,
                subnet_ids=[s.id for s in self.subnets["endpoints"]],
                security_group_ids=[self.endpoint_sg.id],
                tags=tags(p, "endpoints", Name=f"{p}-{svc}"),
                opts=child(self),
            )

        self.vpc_id = self.vpc.id
        self.s3_prefix_list_id = self.s3_endpoint.prefix_list_id
        self.subnet_ids = {tier: [s.id for s in sns] for tier, sns in self.subnets.items()}
        self.harness_capacity = harness_capacity(list(args.harness_subnet_cidrs))
        self.register_outputs(
            {
                "vpcId": self.vpc_id,
                "subnetIds": self.subnet_ids,
                "harnessCapacity": self.harness_capacity,
                "s3PrefixListId": self.s3_prefix_list_id,
            }
        )
