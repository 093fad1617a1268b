"""AWS clients for S3 and SQS, honouring AWS_ENDPOINT_URL (moto's server mode locally, in-VPC endpoints on AWS).

One set of settings (endpoint, region, retries) for every process that uses boto3 (`client`); the shim's ledger
sender (shim/ledger.py) makes its client in its own thread from the same endpoint and region variables."""

from __future__ import annotations

import os
from functools import lru_cache
from urllib.parse import urlparse

from botocore.config import Config

_CONFIG = Config(retries={"max_attempts": 8, "mode": "adaptive"}, max_pool_connections=32)


def _endpoint(service: str) -> str | None:
    return os.environ.get(f"AWS_ENDPOINT_URL_{service.upper()}") or os.environ.get("AWS_ENDPOINT_URL") or None


def _region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


@lru_cache(maxsize=None)
def client(service: str, endpoint_url: str | None = None):
    import boto3

    return boto3.client(service, endpoint_url=endpoint_url or _endpoint(service), region_name=_region(),
                        config=_CONFIG)


@lru_cache(maxsize=None)
def split_s3_uri(uri: str) -> tuple[str, str]:
    p = urlparse(uri)
    if p.scheme != "s3" or not p.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r}")
    return p.netloc, p.path.lstrip("/")


def eval_logs_prefix(artifacts_prefix: str) -> str:
    """Where an attempt's grading logs live under its artifacts prefix (written by eval workers, read by reports)."""
    return artifacts_prefix.rstrip("/") + "/eval/"


def put_text(uri: str, body: str | bytes, content_type: str = "application/json") -> None:
    bucket, key = split_s3_uri(uri)
    data = body.encode() if isinstance(body, str) else body
    client("s3").put_object(Bucket=bucket, Key=key, Body=data, ContentType=content_type)


def get_text(uri: str) -> str:
    bucket, key = split_s3_uri(uri)
    return client("s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def send(queue_url: str, body: str) -> None:
    client("sqs").send_message(QueueUrl=queue_url, MessageBody=body)
