"""shim.sqs, the shim's botocore-free SQS sender: botocore's exact SigV4 signature, SendMessage against moto,
retries, container credentials (token header, refresh near expiry), and no botocore in the shim process."""

from __future__ import annotations

import datetime
import json
import ssl
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials
from shimtest import self_signed_cert

from contract import aws
from shim import sqs
from shim.sqs import Credentials, CredentialsError, SQSError, SQSSender, sign

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime.datetime(2026, 3, 14, 15, 9, 26, tzinfo=datetime.UTC)
HEADERS = {"Content-Type": "application/x-amz-json-1.0", "X-Amz-Target": "AmazonSQS.SendMessage"}
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                   "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                   "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")


@pytest.mark.parametrize("url", ["https://sqs.eu-west-1.amazonaws.com/", "http://127.0.0.1:4566/"])
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//session+token="])
def test_the_signature_is_botocores(monkeypatch, url, token):
    body = json.dumps({"QueueUrl": "https://sqs.eu-west-1.amazonaws.com/1/q", "MessageBody": 'a "b" é'}).encode()
    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: NOW.replace(tzinfo=None))
    request = AWSRequest(method="POST", url=url, headers=dict(HEADERS), data=body)
    key, secret = "AKIDEXAMPLE", "wJalr/XUtnFEMI+K7MDENG"
    SigV4Auth(BotoCredentials(key, secret, token), "sqs", "eu-west-1").add_auth(request)

    ours = sign("POST", url, HEADERS, body, Credentials(key, secret, token), "eu-west-1", "sqs", NOW)
    assert ours["Authorization"] == request.headers["Authorization"]
    assert ours["X-Amz-Date"] == request.headers["X-Amz-Date"] == "20260314T150926Z"
    assert ours.get("X-Amz-Security-Token") == request.headers.get("X-Amz-Security-Token") == token


def test_send_and_receive_through_moto(moto_endpoint, unique):
    boto_sqs = aws.client("sqs")
    queue = boto_sqs.create_queue(QueueName=unique)["QueueUrl"]
    sender = SQSSender()
    assert sender.endpoint == moto_endpoint + "/"
    bodies = ['{"msg": "héllo \\"x\\"\\n"}', "second"]
    for body in bodies:
        sender.send(queue, body)
    got = boto_sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=1)["Messages"]
    assert sorted(m["Body"] for m in got) == sorted(bodies)


def test_an_error_reply_raises_with_the_aws_error_type(moto_endpoint, unique):
    live = aws.client("sqs").create_queue(QueueName=unique)["QueueUrl"]
    with pytest.raises(SQSError, match="QueueDoesNotExist") as e:
        SQSSender().send(live.rsplit("/", 1)[0] + f"/{unique}-missing", "x")
    assert e.value.error_type == "QueueDoesNotExist" and e.value.status == 400


# ------------------------------------------------------------ a fake SQS and container credentials endpoint


class _Fake:
    """What the fake endpoint answers (queued SQS replies, credentials to serve) and what it saw."""

    def __init__(self):
        self.replies: list[tuple[int, dict]] = []  # SQS replies to give before answering 200
        self.creds = {"AccessKeyId": "AKID1", "SecretAccessKey": "secret1", "Token": "token1",
                      "Expiration": _iso(3600)}
        self.creds_status = 200
        self.posts: list[dict[str, str]] = []  # the headers of each SendMessage
        self.bodies: list[bytes] = []
        self.gets: list[dict[str, str]] = []  # the headers of each credentials fetch
        self.connections: set[int] = set()


def _iso(in_s: float) -> str:
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=in_s)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@contextmanager
def _fake_endpoint(tls: ssl.SSLContext | None = None):
    fake = _Fake()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def _answer(self, status: int, doc: dict) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-amz-json-1.0")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            fake.gets.append(dict(self.headers))
            self._answer(fake.creds_status, fake.creds)

        def do_POST(self):
            fake.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            fake.posts.append(dict(self.headers))
            fake.connections.add(id(self.connection))
            self._answer(*(fake.replies.pop(0) if fake.replies else (200, {"MessageId": "m"})))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        yield fake, f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def no_credentials(monkeypatch):
    for name in _CREDENTIAL_ENV:
        monkeypatch.delenv(name, raising=False)


def test_throttling_and_5xx_are_retried_over_one_connection(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    with _fake_endpoint() as (fake, url):
        fake.replies = [(400, {"__type": "com.amazonaws.sqs#RequestThrottled", "message": "slow down"}),
                        (503, {"__type": "ServiceUnavailable", "message": "busy"})]
        sender = SQSSender(url)
        sender.send("q", "x")
        sender.send("q", "y")
        assert len(fake.posts) == 4 and len(fake.connections) == 1

        fake.replies = [(400, {"__type": "com.amazonaws.sqs#AccessDenied", "message": "no"})]
        with pytest.raises(SQSError, match="AccessDenied: no"):
            sender.send("q", "z")
        assert len(fake.posts) == 5  # not retried

        fake.replies = [(500, {"__type": "InternalError", "message": "oops"})] * sqs.ATTEMPTS
        with pytest.raises(SQSError, match="InternalError"):
            sender.send("q", "z")
        assert len(fake.posts) == 5 + sqs.ATTEMPTS


def test_what_is_sent_is_what_was_signed(monkeypatch):
    """botocore, given the request as the endpoint received it (the signed headers), signs it the same."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session")
    with _fake_endpoint() as (fake, url):
        SQSSender(url, "eu-west-1").send(f"{url}/1/q", '{"rows": ["é"]}')
    got = fake.posts[0]
    signed = got["Authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    assert signed == ["content-type", "host", "x-amz-date", "x-amz-security-token", "x-amz-target"]
    when = datetime.datetime.strptime(got["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: when)
    request = AWSRequest(method="POST", url=url + "/", data=fake.bodies[0],
                         headers={k: v for k, v in got.items() if k.lower() in signed})
    SigV4Auth(BotoCredentials("AKIDEXAMPLE", "secret", "session"), "sqs", "eu-west-1").add_auth(request)
    assert request.headers["Authorization"] == got["Authorization"]
    assert json.loads(fake.bodies[0]) == {"QueueUrl": f"{url}/1/q", "MessageBody": '{"rows": ["é"]}'}


def test_https_verifies_the_endpoint_against_aws_ca_bundle(monkeypatch, tmp_path):
    key, cert = self_signed_cert(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    with _fake_endpoint(tls) as (fake, url):
        with pytest.raises(ssl.SSLCertVerificationError):
            SQSSender(url).send("q", "x")
        monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
        SQSSender(url).send("q", "x")
        assert len(fake.posts) == 1 and fake.posts[0]["Host"] == url.removeprefix("https://")


def test_container_credentials_come_with_the_token_and_are_refreshed_near_expiry(monkeypatch, no_credentials):
    with _fake_endpoint() as (fake, url):
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{url}/v1/credentials")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "auth-token-1")
        sender = SQSSender(url)
        sender.send("q", "a")
        sender.send("q", "b")
        assert len(fake.gets) == 1 and fake.gets[0]["Authorization"] == "auth-token-1"
        assert all("Credential=AKID1/" in p["Authorization"] and p["X-Amz-Security-Token"] == "token1"
                   for p in fake.posts)

        fake.creds = {"AccessKeyId": "AKID2", "SecretAccessKey": "secret2", "Token": "token2",
                      "Expiration": _iso(3600)}
        monkeypatch.setattr(sqs, "REFRESH_BEFORE_S", 3700)  # the first ones now expire within the margin
        sender.send("q", "c")
        assert len(fake.gets) == 2
        assert "Credential=AKID2/" in fake.posts[-1]["Authorization"]
        assert fake.posts[-1]["X-Amz-Security-Token"] == "token2"


def test_a_failed_refresh_keeps_credentials_that_are_still_valid(monkeypatch, no_credentials, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    with _fake_endpoint() as (fake, url):
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{url}/creds")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "ignored")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token_file))
        sender = SQSSender(url)
        assert sender.credentials().access_key == "AKID1"
        assert fake.gets[0]["Authorization"] == "from-the-file"

        fake.creds_status = 500
        monkeypatch.setattr(sqs, "REFRESH_BEFORE_S", 3700)
        sender.send("q", "a")
        assert len(fake.gets) == 2 and "Credential=AKID1/" in fake.posts[-1]["Authorization"]

        with pytest.raises(CredentialsError, match="HTTP 500"):  # with nothing cached, the failure is an error
            SQSSender(url).send("q", "b")


def test_the_relative_uri_goes_to_the_ecs_agent(monkeypatch, no_credentials):
    with _fake_endpoint() as (fake, url):
        monkeypatch.setattr(sqs, "ECS_CREDENTIALS_HOST", url)
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials/abc")
        assert sqs.resolve_credentials().secret_key == "secret1"
        assert len(fake.gets) == 1


def test_missing_or_unsafe_credentials_are_refused(monkeypatch, no_credentials):
    with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID.*AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        sqs.resolve_credentials()
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://example.com/creds")
    with pytest.raises(CredentialsError, match="example.com"):
        sqs.resolve_credentials()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with pytest.raises(CredentialsError, match="only one"):
        sqs.resolve_credentials()


def test_the_secret_is_not_in_the_credentials_repr():
    creds = Credentials("AKID", "very-secret", "session-token", None)
    assert "very-secret" not in repr(creds) and "session-token" not in repr(creds)


def test_the_shim_process_never_imports_botocore():
    code = ("import sys, shim.__main__, shim.server, shim.ledger; shim.ledger._warm_default_sender(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('botocore', 'boto3') "
            "or m == 'contract.aws'))")
    env = {"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=env)
    assert out.stdout.strip() == "[]", out.stdout
