"""SQS SendMessage over the AWS JSON protocol, signed (SigV4) here: the shim's results-queue sender without
botocore, whose import and client cost ~23 MB of the shim's 50 MB budget.

The endpoint as contract/aws.py sets it for every other process (AWS_ENDPOINT_URL_SQS, else AWS_ENDPOINT_URL);
the region from AWS_REGION, else AWS_DEFAULT_REGION (what contract/aws.py reads), else us-east-1. Credentials
from the environment, else from the ECS/Fargate (or EKS Pod Identity) container credentials endpoint; no
profiles, no instance metadata: the shim runs in a task.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import json
import logging
import os
import ssl
import threading
import time
from typing import NamedTuple
from urllib.parse import SplitResult, quote, urlsplit

from shim.retry import Backoff

log = logging.getLogger("shim.sqs")

ATTEMPTS = 4  # per send; the ledger retries a failed send later anyway
TIMEOUT_S = 20.0
CREDENTIALS_TIMEOUT_S = 5.0
REFRESH_BEFORE_S = 300.0  # container credentials are fetched anew this long before they expire
ECS_CREDENTIALS_HOST = "http://169.254.170.2"
# FULL_URI over plain http may only name these hosts (as botocore allows): the authorization token goes with it
_CONTAINER_HTTP_HOSTS = frozenset({"localhost", "::1", "169.254.170.2", "169.254.170.23", "fd00:ec2::23"})
# error types worth another attempt inside send (besides 5xx and connection errors)
RETRYABLE_ERRORS = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled", "RequestThrottledException",
    "TooManyRequestsException", "ServiceUnavailable", "InternalError", "InternalFailure", "RequestTimeout",
    "RequestTimeoutException", "KmsThrottled",
})


class SQSError(Exception):
    """An error reply from SQS; `error_type` is the AWS error type (`__type` without its namespace)."""

    def __init__(self, status: int, error_type: str, message: str):
        super().__init__(f"{error_type}: {message} (HTTP {status})")
        self.status = status
        self.error_type = error_type
        self.message = message


class CredentialsError(Exception):
    """No usable AWS credentials (the message says where they were looked for, never what they are)."""


class Credentials(NamedTuple):
    access_key: str
    secret_key: str
    token: str | None = None
    expires: float | None = None  # epoch seconds; None: never (from the environment)

    def __repr__(self) -> str:  # a traceback or log line must not carry the secret
        return f"Credentials(access_key={self.access_key!r}, expires={self.expires!r})"


def endpoint() -> str:
    region = region_name()
    return (os.environ.get("AWS_ENDPOINT_URL_SQS") or os.environ.get("AWS_ENDPOINT_URL")
            or f"https://sqs.{region}.amazonaws.com")


def region_name() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def _host(url: str) -> str:
    """The host header botocore signs: no userinfo, no default port."""
    u = urlsplit(url)
    host = f"[{u.hostname}]" if ":" in (u.hostname or "") else u.hostname
    if u.port is not None and u.port != {"http": 80, "https": 443}.get(u.scheme):
        host = f"{host}:{u.port}"
    return host


def _port(u: SplitResult) -> int:
    """Always given to http.client, which would otherwise read the end of a bare IPv6 address as a port."""
    return u.port or (443 if u.scheme == "https" else 80)


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def sign(method: str, url: str, headers: dict[str, str], body: bytes, creds: Credentials, region: str,
         service: str, now: datetime.datetime) -> dict[str, str]:
    """`headers` plus Host, X-Amz-Date, X-Amz-Security-Token (with a session token) and Authorization: the
    request signed with AWS Signature Version 4, every header sent being signed (`url` has no query string)."""
    stamp = now.astimezone(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = {**headers, "Host": _host(url), "X-Amz-Date": stamp}
    if creds.token:
        out["X-Amz-Security-Token"] = creds.token
    canonical_headers = {k.lower(): " ".join(v.split()) for k, v in out.items()}
    names = sorted(canonical_headers)
    signed_headers = ";".join(names)
    canonical_request = "\n".join([
        method,
        quote(urlsplit(url).path or "/", safe="/~"),
        "",
        "".join(f"{n}:{canonical_headers[n]}\n" for n in names),
        signed_headers,
        hashlib.sha256(body).hexdigest(),
    ])
    scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
    string_to_sign = "\n".join([
        "AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical_request.encode()).hexdigest()])
    key = _hmac(f"AWS4{creds.secret_key}".encode(), stamp[:8])
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                            f"SignedHeaders={signed_headers}, Signature={signature}")
    return out


# ------------------------------------------------------------ credentials


def resolve_credentials() -> Credentials:
    """From AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY(/AWS_SESSION_TOKEN), else the container endpoint."""
    env = os.environ
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return Credentials(key, secret, env.get("AWS_SESSION_TOKEN") or None)
    if key or secret:
        raise CredentialsError("only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY is set")
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        return _container_credentials(ECS_CREDENTIALS_HOST + env["AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"])
    if env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return _container_credentials(env["AWS_CONTAINER_CREDENTIALS_FULL_URI"])
    raise CredentialsError("no AWS credentials: none of AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI, AWS_CONTAINER_CREDENTIALS_FULL_URI is set")


def _container_authorization() -> str | None:
    """The token file (rotated by EKS Pod Identity: read at every fetch) wins over the token, as in botocore."""
    path = os.environ.get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return os.environ.get("AWS_CONTAINER_AUTHORIZATION_TOKEN") or None


def _container_credentials(url: str) -> Credentials:
    u = urlsplit(url)
    host = u.hostname or ""
    if u.scheme not in ("http", "https"):
        raise CredentialsError(f"container credentials URI scheme {u.scheme!r} is not http(s)")
    if u.scheme == "http" and host not in _CONTAINER_HTTP_HOSTS and not host.startswith("127."):
        raise CredentialsError(f"container credentials over http only from loopback or the ECS/EKS agent, "
                               f"not {host}")
    headers = {"Accept": "application/json"}
    authorization = _container_authorization()
    if authorization:
        headers["Authorization"] = authorization
    conn_type = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(host, _port(u), timeout=CREDENTIALS_TIMEOUT_S)
    try:
        conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""), headers=headers)
        resp = conn.getresponse()
        reply = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise CredentialsError(f"the container credentials endpoint answered HTTP {resp.status}")
    try:
        doc = json.loads(reply)
        expires = doc.get("Expiration")
        return Credentials(doc["AccessKeyId"], doc["SecretAccessKey"], doc.get("Token") or None,
                           datetime.datetime.fromisoformat(expires).timestamp() if expires else None)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CredentialsError(f"unreadable container credentials reply ({type(e).__name__})") from None


# ------------------------------------------------------------ the sender


class SQSSender:
    """send(queue_url, body): one SendMessage over one keep-alive connection; thread-safe (sends take turns)."""

    def __init__(self, endpoint_url: str | None = None, region: str | None = None):
        self.endpoint = (endpoint_url or endpoint()).rstrip("/") + "/"
        self.region = region or region_name()
        u = urlsplit(self.endpoint)
        self._https = u.scheme == "https"
        self._netloc = (u.hostname, _port(u))
        self._path = u.path
        self._ssl = None
        if self._https:  # AWS_CA_BUNDLE as botocore honours it (a private CA in front of an in-VPC endpoint)
            self._ssl = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
        self._conn: http.client.HTTPConnection | None = None
        self._creds: Credentials | None = None
        self._lock = threading.Lock()
        self._backoff = Backoff(base_s=0.2, cap_s=2.0, max_retry_after_s=0.0)

    def credentials(self) -> Credentials:
        """The cached credentials, fetched anew near their expiry (kept while still valid if that fails)."""
        with self._lock:
            return self._credentials()

    def _credentials(self) -> Credentials:
        c = self._creds
        if c is None or (c.expires is not None and time.time() > c.expires - REFRESH_BEFORE_S):
            try:
                self._creds = resolve_credentials()
            except Exception as e:
                if c is None or time.time() >= c.expires:
                    raise
                log.warning("AWS credentials refresh failed, the current ones are still valid: %s", e)
                return c
        return self._creds

    def send(self, queue_url: str, body: str) -> None:
        """SendMessage; retried a few times on connection errors, 5xx and throttling, else raises (SQSError,
        CredentialsError, OSError, http.client.HTTPException)."""
        payload = json.dumps({"QueueUrl": queue_url, "MessageBody": body}).encode()
        with self._lock:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    status, reply = self._post(payload)
                except (OSError, http.client.HTTPException):
                    self._close()  # a stale keep-alive connection, a reset: a new connection next attempt
                    if attempt == ATTEMPTS:
                        raise
                else:
                    if status == 200:
                        return
                    error = _error(status, reply)
                    if attempt == ATTEMPTS or (status < 500 and error.error_type not in RETRYABLE_ERRORS):
                        raise error
                time.sleep(self._backoff.delay(attempt))

    def _post(self, payload: bytes) -> tuple[int, bytes]:
        headers = sign("POST", self.endpoint,
                       {"Content-Type": "application/x-amz-json-1.0", "X-Amz-Target": "AmazonSQS.SendMessage"},
                       payload, self._credentials(), self.region, "sqs", datetime.datetime.now(datetime.UTC))
        if self._conn is None:
            host, port = self._netloc
            self._conn = (http.client.HTTPSConnection(host, port, timeout=TIMEOUT_S, context=self._ssl)
                          if self._https else http.client.HTTPConnection(host, port, timeout=TIMEOUT_S))
        self._conn.request("POST", self._path, payload, headers)
        resp = self._conn.getresponse()
        reply = resp.read()
        if resp.will_close:
            self._close()
        return resp.status, reply

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _error(status: int, reply: bytes) -> SQSError:
    """The JSON protocol's error reply ({"__type": "com.amazonaws.sqs#QueueDoesNotExist", "message": ...})."""
    try:
        doc = json.loads(reply)
        return SQSError(status, str(doc["__type"]).rsplit("#", 1)[-1],
                        str(doc.get("message") or doc.get("Message") or ""))
    except (ValueError, KeyError, TypeError):
        return SQSError(status, f"HTTP{status}", reply[:200].decode("utf-8", "replace"))
