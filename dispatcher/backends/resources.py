"""Per-run resources: the S3 prefix, the results and eval queues (each with a dead-letter queue), and the verdict
queue (eval workers send verdicts there, and only they may: IAM on AWS; its dead letters go to the results DLQ)."""

from __future__ import annotations

import contextlib
import json
import re

from botocore.exceptions import ClientError
from pydantic import BaseModel

from contract import aws
from contract.models import AttemptRef

DEFAULT_BUCKET = "evalplane-local"
MAX_RECEIVES = 5  # deliveries before a message goes to the dead-letter queue


class RunResources(BaseModel):
    run: str
    bucket: str
    results_queue_url: str
    eval_queue_url: str
    verdict_queue_url: str
    results_dlq_url: str
    eval_dlq_url: str

    @property
    def prefix(self) -> str:
        return f"s3://{self.bucket}/runs/{self.run}/"

    def job_uri(self, ref: AttemptRef) -> str:
        return f"{self.prefix}jobs/{ref.instance_id}/{ref.attempt}.json"

    def artifacts_prefix(self, ref: AttemptRef) -> str:
        return artifacts_prefix(self.bucket, ref)


def artifacts_prefix(bucket: str, ref: AttemptRef) -> str:
    """An attempt's S3 prefix: patch, trajectory, ledger copy and eval logs."""
    return f"s3://{bucket}/runs/{ref.run}/attempts/{ref.instance_id}/{ref.attempt}/"


def _queue_name(run: str, role: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_-]", "-", f"ep-{run}-{role}")[:80]


def verdict_queue_name(run: str) -> str:
    """`ep-<run>-verdicts`: the estate's IAM lets only the eval role send to `<queuePrefix>ep-*-verdicts`."""
    return _queue_name(run, "verdicts")


def _ensure_queue(name: str, attrs: dict[str, str]) -> str:
    return aws.client("sqs").create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]


def ensure(run: str, bucket: str = DEFAULT_BUCKET, queue_prefix: str = "") -> RunResources:
    """Create (or find) the run's bucket prefix and queues; idempotent."""
    s3, sqs = aws.client("s3"), aws.client("sqs")
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError:  # 404: not made yet
        s3.create_bucket(Bucket=bucket)
    urls = {}
    for role in ("results", "eval"):
        dlq = _ensure_queue(queue_prefix + _queue_name(run, f"{role}-dlq"), {"MessageRetentionPeriod": "1209600"})
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        urls[role] = _ensure_queue(
            queue_prefix + _queue_name(run, role),
            {
                "VisibilityTimeout": "120" if role == "results" else "600",
                "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(MAX_RECEIVES)}),
            },
        )
        urls[f"{role}_dlq"] = dlq
        if role == "results":
            urls["verdicts"] = _ensure_queue(queue_prefix + verdict_queue_name(run), {
                "VisibilityTimeout": "120",
                "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(MAX_RECEIVES)}),
            })
    return RunResources(
        run=run, bucket=bucket, results_queue_url=urls["results"], eval_queue_url=urls["eval"],
        verdict_queue_url=urls["verdicts"],
        results_dlq_url=urls["results_dlq"], eval_dlq_url=urls["eval_dlq"],
    )


def remove_queues(res: RunResources) -> None:
    """At the run's end: the queues go (their contents have landed); the S3 prefix stays as the record."""
    sqs = aws.client("sqs")
    for url in (res.results_queue_url, res.eval_queue_url, res.verdict_queue_url, res.results_dlq_url,
                res.eval_dlq_url):
        with contextlib.suppress(ClientError):  # gone already
            sqs.delete_queue(QueueUrl=url)
