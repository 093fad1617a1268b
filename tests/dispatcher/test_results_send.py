"""The lost result (issue 26): what dropped it, and every send of a results message checked.

The cause: moto's SQS Queue.delete_message rebuilds the queue's message list from a snapshot without the lock that
SendMessage appends under. With two writers deleting at once, a message sent between the first rebuild and the end
of the second is dropped, though SendMessage answered with its MessageId: the bench's bench__sim-616, in neither
the results queue nor its dead-letter queue. The interleaving is forced here, on moto's own Queue, step by step.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
from botocore.stub import Stubber
from moto.sqs.models import Message, Queue, SQSBackend
from tenacity import wait_none

from contract import aws
from dispatcher.backends import moto_server


class Gate:
    """Makes a message's receipt-handle check pause the thread named deleter-a (mid-rebuild of the list)."""

    def __init__(self, m: Message):
        self.paused, self.resume = threading.Event(), threading.Event()
        check = m.had_receipt_handle

        def had_receipt_handle(receipt_handle: str) -> bool:
            if threading.current_thread().name == "deleter-a":
                self.paused.set()
                self.resume.wait(5)
            return check(receipt_handle)

        m.had_receipt_handle = had_receipt_handle


def received(queue: Queue, body: str) -> Message:
    m = Message(body, body)
    m.mark_sent()
    queue.add_message(m)
    m.mark_received(visibility_timeout=600)
    return m


def race(delete) -> list[str]:
    """Writer A and writer B each delete a message they landed while a task sends its result; A is paused in the
    middle of rebuilding the list. Returns the bodies left on the queue."""
    q = Queue("results", "us-east-1", "123456789012")
    a = received(q, "a")
    b = received(q, "b")
    gate = Gate(received(q, "held"))  # last in the list: A's rebuild pauses on it, B's does not
    deleter_a = threading.Thread(target=delete, args=(q, a.receipt_handle), name="deleter-a")
    deleter_a.start()
    assert gate.paused.wait(5)
    deleter_b = threading.Thread(target=delete, args=(q, b.receipt_handle), name="deleter-b")
    sender = threading.Thread(target=lambda: received(q, "result of bench__sim-616"), name="task")
    deleter_b.start()
    deleter_b.join(0.5)  # stock moto: B's rebuild completes now; serialized: B waits for A
    sender.start()
    sender.join(0.5)
    gate.resume.set()
    for t in (deleter_a, deleter_b, sender):
        t.join(5)
        assert not t.is_alive()
    return sorted(m.body for m in q._messages)


def test_stock_moto_drops_a_result_sent_while_two_deletes_rebuild_the_queue():
    left = race(moto_server.stock_delete_message)
    assert "result of bench__sim-616" not in left  # acknowledged by SendMessage, gone
    assert "b" in left  # and B's deleted message is back (a redelivery: harmless, the unique keys absorb it)


def test_the_stand_in_keeps_every_message():
    assert race(moto_server.serialized(moto_server.stock_delete_message)) == ["held", "result of bench__sim-616"]


@pytest.fixture
def stock_moto(monkeypatch):
    """moto's SQS as it ships, restored to whatever it was after the test."""
    monkeypatch.setattr(Queue, "delete_message", moto_server.stock_delete_message)
    for name, value in moto_server.stock.items():
        monkeypatch.setattr(Queue if name in vars(Queue) else SQSBackend, name, value)


def test_the_stand_in_server_is_patched(stock_moto):
    moto_server.patch()
    assert getattr(Queue.delete_message, "serialized", False)
    moto_server.patch()  # idempotent: not wrapped twice
    assert Queue.delete_message.__wrapped__ is moto_server.stock_delete_message


# ------------------------------------------------------------------ what the queue accepted


def test_send_batch_lands_every_body_and_checks_what_sqs_stored(moto_endpoint, unique):
    sqs = aws.client("sqs")
    q = sqs.create_queue(QueueName=unique)["QueueUrl"]
    bodies = [f'{{"n": {i}}}' for i in range(23)]  # three calls: 10 + 10 + 3
    aws.send_batch(q, bodies)
    aws.send(q, '{"n": 23}')
    got = []
    while msgs := sqs.receive_message(QueueUrl=q, MaxNumberOfMessages=10).get("Messages", []):
        got += [m["Body"] for m in msgs]
    assert sorted(got) == sorted([*bodies, '{"n": 23}'])
    sqs.delete_queue(QueueUrl=q)


def _stubbed(monkeypatch):
    """SQS answers moto never gives (a failed batch entry, a body stored other than sent), from botocore's Stubber
    on a real client."""
    client = aws.client("sqs", "http://127.0.0.1:9")  # never reached: the stubber answers
    monkeypatch.setattr(aws, "client", lambda service, endpoint_url=None: client)
    monkeypatch.setattr(aws, "_RETRY_WAIT", wait_none())
    return Stubber(client)


def test_a_failed_entry_is_sent_again_until_sqs_takes_it(monkeypatch):
    stub = _stubbed(monkeypatch)
    q = "http://sqs.invalid/1/results"
    bodies = ["a", "b"]
    md5 = {b: aws.md5_of(b) for b in bodies}
    stub.add_response("send_message_batch", {
        "Successful": [{"Id": "0", "MessageId": "m0", "MD5OfMessageBody": md5["a"]}],
        "Failed": [{"Id": "1", "SenderFault": False, "Code": "InternalError", "Message": "try again"}]},
        {"QueueUrl": q, "Entries": [{"Id": "0", "MessageBody": "a"}, {"Id": "1", "MessageBody": "b"}]})
    stub.add_response("send_message_batch", {
        "Successful": [{"Id": "1", "MessageId": "m1", "MD5OfMessageBody": md5["b"]}], "Failed": []},
        {"QueueUrl": q, "Entries": [{"Id": "1", "MessageBody": "b"}]})  # only the failed entry goes again
    with stub:
        aws.send_batch(q, bodies)
        stub.assert_no_pending_responses()


def test_a_refused_entry_fails_loudly_naming_it(monkeypatch):
    stub = _stubbed(monkeypatch)
    q = "http://sqs.invalid/1/results"
    stub.add_response("send_message_batch", {
        "Successful": [], "Failed": [{"Id": "0", "SenderFault": True, "Code": "InvalidMessageContents",
                                      "Message": "bad characters"}]})
    with stub, pytest.raises(aws.SendFailed, match=r"entry 0: InvalidMessageContents \(bad characters\)"):
        aws.send_batch(q, ["\x00"])  # a sender fault is not retried: resending the same body cannot help


def test_a_body_stored_other_than_sent_is_sent_again_then_fails_loudly(monkeypatch):
    stub = _stubbed(monkeypatch)
    q = "http://sqs.invalid/1/results"
    for _ in range(aws.SEND_TRIES):
        stub.add_response("send_message", {"MessageId": "m", "MD5OfMessageBody": aws.md5_of("something else")})
    with stub, pytest.raises(aws.SendFailed, match="MD5"):
        aws.send(q, "the result")
    stub.assert_no_pending_responses()


def backend_with(n: int) -> SQSBackend:
    """A fresh SQS backend whose queue "q" holds n messages."""
    b = SQSBackend("us-east-1", "123456789012")
    b.create_queue("q")
    for i in range(n):
        b.send_message("q", f"m{i}")
    return b


@contextlib.contextmanager
def visibility_checks(monkeypatch):
    """Counts Message.visible evaluations inside the block: [count]."""
    checks = [0]
    stock = Message.visible

    def counted(self):
        checks[0] += 1
        return stock.fget(self)

    monkeypatch.setattr(Message, "visible", property(counted))
    try:
        yield checks
    finally:
        monkeypatch.setattr(Message, "visible", stock)


def test_the_stand_in_sends_and_receives_without_scanning_the_queue_and_still_counts(stock_moto, monkeypatch):
    """moto counts every message in the queue for each one sent or received (its attributes, read several times a
    message): in the stand-in a message costs the same whatever the depth, and GetQueueAttributes still counts."""

    def one_sent_and_one_received(backend: SQSBackend) -> int:
        with visibility_checks(monkeypatch) as checks:
            backend.send_message("q", "one more")
            backend.receive_message("q", 1, 0, 30)
        return checks[0]

    stock_checks = one_sent_and_one_received(backend_with(500))
    moto_server.patch()
    b = backend_with(500)
    assert one_sent_and_one_received(b) < 600 < 4 * 500 < stock_checks  # one scan to pick the message, no counting
    b.receive_message("q", 3, 0, 30)
    got = b.get_queue_attributes("q", ["All"])
    assert (got["ApproximateNumberOfMessages"], got["ApproximateNumberOfMessagesNotVisible"]) == (497, 4)


def test_the_stand_in_receives_and_deletes_without_walking_the_whole_queue_and_deletes_as_moto_does(
        stock_moto, monkeypatch):
    """A receive reads the visible messages only as far as it takes them; a DeleteMessageBatch walks the queue once
    for its entries: deleted, already deleted (success again), or unknown (ReceiptHandleIsInvalid), as moto answers."""
    moto_server.patch()
    b = backend_with(500)
    with visibility_checks(monkeypatch) as checks:
        got = b.receive_message("q", 10, 0, 30)
    assert len(got) == 10 and checks[0] < 50  # not 500
    first = b.receive_message("q", 1, 1, 30)  # a long poll with messages visible answers at once
    assert len(first) == 1

    entries = [{"Id": str(i), "ReceiptHandle": m.receipt_handle} for i, m in enumerate(got[:3])]
    assert b.delete_message_batch("q", entries) == (["0", "1", "2"], [])
    ok, failed = b.delete_message_batch("q", [*entries[:1], {"Id": "x", "ReceiptHandle": "not-a-handle"}])
    assert ok == ["0"] and [(f["Id"], f["Code"]) for f in failed] == [("x", "ReceiptHandleIsInvalid")]
    left = b.get_queue_attributes("q", ["All"])
    assert (left["ApproximateNumberOfMessages"], left["ApproximateNumberOfMessagesNotVisible"]) == (489, 8)
