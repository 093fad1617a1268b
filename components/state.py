"""State: the KMS key, Aurora PostgreSQL Serverless v2, the Valkey replication group, the artifact bucket, ECR.

Valkey requires TLS and a user (an RBAC user group, the default user off): the dispatcher's user has every key; the
harness user (tasks, the judge) only run keys and pool pacing keys, no admin commands
(contract.valkey_auth.task_rules); the gateway's user its own LiteLLM keys. Each user's name and password are a
Secrets Manager secret ({"username", "password"}) that task definitions hand to their containers as ECS secrets. The
verdict key (eval workers sign verdicts with it, the results writer checks them) is a secret too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.common import child, tags
from contract import valkey_auth

RUNS_PREFIX = "runs/"
CONFIG_PREFIX = "config/"
KIND_TAG = "evalplane:kind"  # object tag the lifecycle rules key on: "log" or "trajectory"
REPOSITORIES = ("harness-base", "eval-images", "platform")
# ElastiCache user name -> its access string. The group must hold a user named "default"; ours is off.
LITELLM_KEYS = "~* -@dangerous"  # LiteLLM's router keys are its own; the gateway is ours, not the agent's
VALKEY_USERS = {
    "default": "off -@all",
    "dispatcher": "on ~* &* +@all",
    "harness": "on " + " ".join(valkey_auth.task_rules("*", "*")),
    "gateway": "on &* +@all " + LITELLM_KEYS,
}


# getRandomPassword answers anew on every `pulumi up`: whatever holds a generated password keeps its first value
# (a later up would otherwise rotate every password and the verdict key under a live run). Rotate by replacing.
KEEP_SECRET_STRING = ["secret_string"]
KEEP_PASSWORDS = ["authentication_mode"]


def generated_password(name: str) -> pulumi.Output[str]:
    """A generated password (alphanumeric: ElastiCache refuses some punctuation), kept secret in the state; its
    consumers ignore changes (KEEP_SECRET_STRING, KEEP_PASSWORDS)."""
    return pulumi.Output.secret(aws.secretsmanager.get_random_password_output(
        password_length=40, exclude_punctuation=True).random_password)


@dataclass(frozen=True)
class StateArgs:
    prefix: str
    data_subnet_ids: list[pulumi.Input[str]]
    aurora_sg_id: pulumi.Input[str]
    valkey_sg_id: pulumi.Input[str]
    aurora_engine_version: str = "16.6"
    aurora_min_acu: float = 0.0
    aurora_max_acu: float = 16.0
    valkey_node_type: str = "cache.t4g.small"
    valkey_engine_version: str = "8.0"
    protect_data: bool = True
    log_expiry_days: int = 90
    trajectory_ia_days: int = 30
    trajectory_expiry_days: int = 365


class State(pulumi.ComponentResource):
    def __init__(self, name: str, args: StateArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("evalplane:state:State", name, None, opts)
        p = args.prefix
        t = tags(p, "data")

        self.key = aws.kms.Key(
            f"{name}-key",
            description=f"{p}: Aurora, Valkey, the artifact bucket and the secrets",
            enable_key_rotation=True,
            deletion_window_in_days=30,
            tags=t,
            opts=child(self),
        )
        aws.kms.Alias(f"{name}-key-alias", name=f"alias/{p}", target_key_id=self.key.key_id, opts=child(self))

        # ---- Aurora PostgreSQL Serverless v2; the master password lives in Secrets Manager (RDS-managed)
        db_subnets = aws.rds.SubnetGroup(
            f"{name}-db-subnets", subnet_ids=args.data_subnet_ids, tags=t, opts=child(self)
        )
        self.aurora = aws.rds.Cluster(
            f"{name}-aurora",
            engine="aurora-postgresql",
            engine_mode="provisioned",
            engine_version=args.aurora_engine_version,
            database_name=p.replace("-", "_"),
            master_username=p.replace("-", "_"),
            manage_master_user_password=True,
            master_user_secret_kms_key_id=self.key.arn,
            storage_encrypted=True,
            kms_key_id=self.key.arn,
            db_subnet_group_name=db_subnets.name,
            vpc_security_group_ids=[args.aurora_sg_id],
            serverlessv2_scaling_configuration=aws.rds.ClusterServerlessv2ScalingConfigurationArgs(
                min_capacity=args.aurora_min_acu,
                max_capacity=args.aurora_max_acu,
                seconds_until_auto_pause=3600 if args.aurora_min_acu == 0 else None,
            ),
            backup_retention_period=7,
            copy_tags_to_snapshot=True,
            deletion_protection=args.protect_data,
            skip_final_snapshot=not args.protect_data,
            final_snapshot_identifier=f"{p}-final" if args.protect_data else None,
            tags=t,
            opts=child(self),
        )
        aws.rds.ClusterInstance(
            f"{name}-aurora-1",
            cluster_identifier=self.aurora.id,
            instance_class="db.serverless",
            engine=self.aurora.engine,
            engine_version=self.aurora.engine_version,
            db_subnet_group_name=db_subnets.name,
            tags=t,
            opts=child(self),
        )
        self.aurora_secret_arn = self.aurora.master_user_secrets.apply(
            lambda s: s[0].secret_arn if s else ""
        )

        # ---- Valkey: primary + replica across AZs, TLS required, encrypted at rest, a user and password required
        cache_subnets = aws.elasticache.SubnetGroup(
            f"{name}-valkey-subnets", subnet_ids=args.data_subnet_ids, tags=t, opts=child(self)
        )
        self.valkey_users: dict[str, aws.elasticache.User] = {}
        self.valkey_secrets: dict[str, aws.secretsmanager.Secret] = {}
        for role, access in VALKEY_USERS.items():
            user_name = role if role == "default" else f"{p}-{role}"
            password = generated_password(role)
            self.valkey_users[role] = aws.elasticache.User(
                f"{name}-valkey-{role}",
                user_id=f"{p}-{role}",
                user_name=user_name,
                engine="valkey",
                access_string=access,
                authentication_mode={"type": "password", "passwords": [password]},
                tags=t,
                opts=child(self, ignore_changes=KEEP_PASSWORDS),
            )
            if role == "default":
                continue
            secret = self.valkey_secrets[role] = aws.secretsmanager.Secret(
                f"{name}-valkey-{role}-secret",
                name_prefix=f"{p}/valkey/{role}-",
                description=f"Valkey user {user_name}: {{username, password}}",
                kms_key_id=self.key.arn,
                tags=t,
                opts=child(self),
            )
            aws.secretsmanager.SecretVersion(
                f"{name}-valkey-{role}-secret-value",
                secret_id=secret.id,
                secret_string=pulumi.Output.json_dumps({"username": user_name, "password": password}),
                opts=child(self, ignore_changes=KEEP_SECRET_STRING),
            )
        self.valkey_user_group = aws.elasticache.UserGroup(
            f"{name}-valkey-users",
            user_group_id=f"{p}-valkey",
            engine="valkey",
            user_ids=[u.user_id for u in self.valkey_users.values()],
            tags=t,
            opts=child(self),
        )
        # The verdict key: eval workers sign verdicts with it (an ECS secret), the results writer checks them.
        self.verdict_key = aws.secretsmanager.Secret(
            f"{name}-verdict-key",
            name_prefix=f"{p}/eval/verdict-key-",
            description="The key eval workers sign verdicts with; the results writer lands no verdict without it",
            kms_key_id=self.key.arn,
            tags=t,
            opts=child(self),
        )
        aws.secretsmanager.SecretVersion(
            f"{name}-verdict-key-value",
            secret_id=self.verdict_key.id,
            secret_string=generated_password("verdict-key"),
            opts=child(self, ignore_changes=KEEP_SECRET_STRING),
        )
        self.valkey = aws.elasticache.ReplicationGroup(
            f"{name}-valkey",
            description=f"{p} pacer, progress keys and rate counters",
            engine="valkey",
            engine_version=args.valkey_engine_version,
            node_type=args.valkey_node_type,
            num_cache_clusters=2,
            automatic_failover_enabled=True,
            multi_az_enabled=True,
            port=6379,
            transit_encryption_enabled=True,
            transit_encryption_mode="required",
            at_rest_encryption_enabled=True,
            kms_key_id=self.key.arn,
            user_group_ids=[self.valkey_user_group.user_group_id],
            subnet_group_name=cache_subnets.name,
            security_group_ids=[args.valkey_sg_id],
            tags=t,
            opts=child(self),
        )

        # ---- the artifact bucket
        self.bucket = aws.s3.Bucket(f"{name}-artifacts", force_destroy=False, tags=t, opts=child(self))
        aws.s3.BucketOwnershipControls(
            f"{name}-artifacts-ownership",
            bucket=self.bucket.id,
            rule={"object_ownership": "BucketOwnerEnforced"},
            opts=child(self),
        )
        aws.s3.BucketPublicAccessBlock(
            f"{name}-artifacts-pab",
            bucket=self.bucket.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=child(self),
        )
        aws.s3.BucketVersioning(
            f"{name}-artifacts-versioning",
            bucket=self.bucket.id,
            versioning_configuration={"status": "Enabled"},
            opts=child(self),
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-artifacts-sse",
            bucket=self.bucket.id,
            rules=[
                {
                    "apply_server_side_encryption_by_default": {
                        "sse_algorithm": "aws:kms",
                        "kms_master_key_id": self.key.arn,
                    },
                    "bucket_key_enabled": True,
                }
            ],
            opts=child(self),
        )
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-artifacts-lifecycle",
            bucket=self.bucket.id,
            rules=[
                {
                    "id": "logs",
                    "status": "Enabled",
                    "filter": {"tag": {"key": KIND_TAG, "value": "log"}},
                    "expiration": {"days": args.log_expiry_days},
                },
                {
                    "id": "trajectories",
                    "status": "Enabled",
                    "filter": {"tag": {"key": KIND_TAG, "value": "trajectory"}},
                    "transitions": [{"days": args.trajectory_ia_days, "storage_class": "STANDARD_IA"}],
                    "expiration": {"days": args.trajectory_expiry_days},
                },
                {
                    "id": "housekeeping",
                    "status": "Enabled",
                    "filter": {"prefix": ""},
                    "noncurrent_version_expiration": {"noncurrent_days": 30},
                    "abort_incomplete_multipart_upload": {"days_after_initiation": 7},
                },
            ],
            opts=child(self),
        )
        aws.s3.BucketPolicy(
            f"{name}-artifacts-tls-only",
            bucket=self.bucket.id,
            policy=self.bucket.arn.apply(
                lambda arn: json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [
                            {
                                "Sid": "DenyInsecureTransport",
                                "Effect": "Deny",
                                "Principal": "*",
                                "Action": "s3:*",
                                "Resource": [arn, f"{arn}/*"],
                                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                            }
                        ],
                    }
                )
            ),
            opts=child(self),
        )

        # ---- ECR: the harness base, the per-instance eval images, and our own images (shim, workers, judge)
        self.repositories = {
            r: aws.ecr.Repository(
                f"{name}-{r}",
                name=f"{p}/{r}",
                image_tag_mutability="IMMUTABLE",
                image_scanning_configuration={"scan_on_push": True},
                encryption_configurations=[{"encryption_type": "AES256"}],
                tags=tags(p, "registry"),
                opts=child(self),
            )
            for r in REPOSITORIES
        }

        self.key_arn = self.key.arn
        self.bucket_name = self.bucket.bucket
        self.bucket_arn = self.bucket.arn
        self.aurora_endpoint = self.aurora.endpoint
        self.valkey_endpoint = self.valkey.primary_endpoint_address
        self.valkey_arn = self.valkey.arn
        self.valkey_secret_arns = {k: v.arn for k, v in self.valkey_secrets.items()}
        self.verdict_key_arn = self.verdict_key.arn
        self.repo_arns = {k: v.arn for k, v in self.repositories.items()}
        self.repo_urls = {k: v.repository_url for k, v in self.repositories.items()}
        self.register_outputs(
            {
                "bucket": self.bucket_name,
                "auroraEndpoint": self.aurora_endpoint,
                "auroraSecretArn": self.aurora_secret_arn,
                "valkeyEndpoint": self.valkey_endpoint,
                "repositoryUrls": self.repo_urls,
            }
        )
