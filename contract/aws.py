"""AWS clients for S3 and SQS, honouring AWS_ENDPOINT_URL (moto's server mode locally, in-VPC endpoints on AWS).

One set of settings (endpoint, region, retries) for every process that uses boto3 (`client`); the shim's ledger
sender (shim/ledger.py) makes its client in its own thread from the same endpoint and region variables."""

from __future__ import annotations

import hashlib
import os
from functools import cache
from urllib.parse import urlparse

from botocore.config import Config
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from contract.signing import SIG_ATTRIBUTE

_CONFIG = Config(retries={"max_attempts": 8, "mode": "adaptive"}, max_pool_connections=32)


def _endpoint(service: str) -> str | None:
    return os.environ.get(f"AWS_ENDPOINT_URL_{service.upper()}") or os.environ.get("AWS_ENDPOINT_URL") or None


def _region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


@cache
def client(service: str, endpoint_url: str | None = None):
    import boto3

    return boto3.client(service, endpoint_url=endpoint_url or _endpoint(service), region_name=_region(),
                        config=_CONFIG)


@cache
def split_s3_uri(uri: str) -> tuple[str, str]:
    p = urlparse(uri)
    if p.scheme != "s3" or not p.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r}")
    return p.netloc, p.path.lstrip("/")


def eval_logs_prefix(artifacts_prefix: str) -> str:
    """Where an attempt's grading logs live under its artifacts prefix (written by eval workers, read by reports)."""
    return artifacts_prefix.rstrip("/") + "/eval/"


def result_copy_uri(artifacts_prefix: str) -> str:
    """The task's copy of its result message (ledger tail included), stored before the message is sent: what the
    dispatcher lands if the message never arrives."""
    return artifacts_prefix.rstrip("/") + "/result.json"


def ledger_copy_uri(artifacts_prefix: str) -> str:
    """The task's copy of its shim's whole ledger (every call's row)."""
    return artifacts_prefix.rstrip("/") + "/ledger.jsonl"


def put_text(uri: str, body: str | bytes, content_type: str = "application/json", sign=None) -> None:
    """sign: a contract.signing signer; its signature of the body goes in the object's metadata."""
    bucket, key = split_s3_uri(uri)
    data = body.encode() if isinstance(body, str) else body
    extra = {"Metadata": {SIG_ATTRIBUTE: sign(data)}} if sign else {}
    client("s3").put_object(Bucket=bucket, Key=key, Body=data, ContentType=content_type, **extra)


def get_text(uri: str) -> str:
    bucket, key = split_s3_uri(uri)
    return client("s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def get_signed_if_exists(uri: str) -> tuple[str, str | None] | None:
    """(the object's text, the signature in its metadata or None), or None if there is no such object."""
    bucket, key = split_s3_uri(uri)
    s3 = client("s3")
    try:
        obj = s3.get_object(Bucket=bucket, Key=key)
    except s3.exceptions.NoSuchKey:
        return None
    return obj["Body"].read().decode(), obj.get("Metadata", {}).get(SIG_ATTRIBUTE)


def get_text_if_exists(uri: str) -> str | None:
    """The object's text, or None if there is no such object (any other failure raises)."""
    s3 = client("s3")
    try:
        return get_text(uri)
    except s3.exceptions.NoSuchKey:
        return None


SEND_TRIES = 5  # per message, on top of botocore's own retries of a failed call
BATCH_ENTRIES, BATCH_BYTES = 10, 256 * 1024  # SendMessageBatch's limits: entries, and their bodies together
_RETRY_WAIT = wait_exponential_jitter(multiplier=0.2, max=5.0)


class SendFailed(RuntimeError):
    """SQS did not take a message (a refused entry, or a body stored other than sent), after every retry."""


class _Unaccepted(Exception):
    """Some entries are not on the queue yet, for a reason another try may fix."""


def md5_of(body: str) -> str:
    """What SQS answers as MD5OfMessageBody for a body it stored as sent."""
    return hashlib.md5(body.encode()).hexdigest()


def _retrying() -> Retrying:
    return Retrying(stop=stop_after_attempt(SEND_TRIES), wait=_RETRY_WAIT,
                    retry=retry_if_exception_type(_Unaccepted), reraise=True)


def signature_attributes(body: str, sign) -> dict:
    """The message attributes that carry a body's signature (none without a signer)."""
    return {SIG_ATTRIBUTE: {"DataType": "String", "StringValue": sign(body)}} if sign else {}


def send(queue_url: str, body: str, sign=None) -> None:
    """One message; returns once SQS has stored exactly this body, else raises SendFailed. sign: a
    contract.signing signer, whose signature of the body travels as a message attribute."""
    attrs = signature_attributes(body, sign)
    try:
        for attempt in _retrying():
            with attempt:
                got = client("sqs").send_message(QueueUrl=queue_url, MessageBody=body,
                                                 **({"MessageAttributes": attrs} if attrs else {})
                                                 ).get("MD5OfMessageBody")
                if got != md5_of(body):
                    raise _Unaccepted(f"SQS stored a body whose MD5 is {got}, not the one sent")
    except _Unaccepted as e:
        raise SendFailed(f"{queue_url}: {e}") from None


SIGNED_OVERHEAD = 128  # a signature attribute's bytes (name, type, value), which count toward SQS's size limit


def _chunks(bodies: list[str], overhead: int = 0):
    """SendMessageBatch-sized groups: at most 10 entries, their bodies (and attributes) at most 256 KiB together."""
    group: list[str] = []
    size = 0
    for b in bodies:
        n = len(b.encode()) + overhead
        if group and (len(group) == BATCH_ENTRIES or size + n > BATCH_BYTES):
            yield group
            group, size = [], 0
        group.append(b)
        size += n
    if group:
        yield group


def send_batch(queue_url: str, bodies: list[str], sign=None) -> None:
    """Many messages, up to ten a call; returns once SQS has stored every body as sent. A failed entry SQS calls
    its own fault (or one stored other than sent) is sent again; one it calls ours, or one still failing after
    SEND_TRIES, raises SendFailed naming it. sign: as for `send`."""
    for group in _chunks(bodies, SIGNED_OVERHEAD if sign else 0):
        todo = {str(i): b for i, b in enumerate(group)}
        refused: list[str] = []
        try:
            for attempt in _retrying():
                with attempt:
                    resp = client("sqs").send_message_batch(
                        QueueUrl=queue_url, Entries=[{"Id": i, "MessageBody": b}
                                                     | ({"MessageAttributes": signature_attributes(b, sign)} if sign else {})
                                                     for i, b in todo.items()])
                    again: dict[str, str] = {}
                    for ok in resp.get("Successful", []):
                        if ok.get("MD5OfMessageBody") != md5_of(todo[ok["Id"]]):
                            again[ok["Id"]] = todo[ok["Id"]]
                    for f in resp.get("Failed", []):
                        why = f"entry {f['Id']}: {f.get('Code')} ({f.get('Message', '')})"
                        if f.get("SenderFault"):
                            refused.append(why)
                        else:
                            again[f["Id"]] = todo[f["Id"]]
                    answered = {e["Id"] for e in resp.get("Successful", []) + resp.get("Failed", [])}
                    again |= {i: b for i, b in todo.items() if i not in answered}  # not answered: not taken
                    if refused:
                        break
                    todo = again
                    if todo:
                        raise _Unaccepted(f"entries {sorted(todo)} not taken")
        except _Unaccepted as e:
            raise SendFailed(f"{queue_url}: {e} after {SEND_TRIES} tries") from None
        if refused:
            raise SendFailed(f"{queue_url}: SQS refused " + "; ".join(refused))
