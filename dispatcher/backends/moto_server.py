"""moto's server as the local S3/SQS stand-in, with its SQS queue's lost-message race fixed and its per-message
scans of the whole queue removed: `python -m dispatcher.backends.moto_server -H HOST -p PORT` (moto_server's own arguments).

- The race: moto serves each request on its own thread, and its Queue.delete_message rebuilds the queue's message
  list from a snapshot without the lock SendMessage appends under. A message sent while a delete is rebuilding the
  list (two writers deleting at once widen the window to a whole rebuild) is dropped: SendMessage answered with its
  MessageId, the message is in neither the queue nor its dead-letter queue. Here the rebuild runs under that lock.
  tests/dispatcher/test_results_send.py reproduces the loss on the stock method and shows it gone.
- The cost: sending or receiving one message reads the queue's attributes several times, and each read counts the
  visible, in-flight and delayed messages by scanning every message in the queue (clock calls included), so a
  message cost grows with the queue's depth and a backed-up results queue collapses. Inside those operations
  nothing uses the counts: there they read 0; GetQueueAttributes still counts. Likewise a receive listed every
  visible message (two clock reads each) to take ten: inside a receive the list is walked only as far as needed;
  and a delete walked the whole queue twice per message: DeleteMessageBatch walks it once for its ten, and
  only as far as its last message (received messages are near the front).
"""

from __future__ import annotations

import functools
import sys
import threading

from moto.sqs.models import Queue, SQSBackend

stock_delete_message = Queue.delete_message
COUNTS = ("approximate_number_of_messages", "approximate_number_of_messages_delayed",
          "approximate_number_of_messages_not_visible")
MESSAGE_OPS = ("send_message", "send_message_batch", "receive_message")
_in_message_op = threading.local()
stock = {name: getattr(Queue, name) for name in (*COUNTS, "messages")} | {
    name: getattr(SQSBackend, name) for name in (*MESSAGE_OPS, "delete_message_batch")}


def serialized(delete):
    """Queue.delete_message under the queue's own message lock (the Condition add_message holds)."""

    @functools.wraps(delete)
    def delete_message(self: Queue, receipt_handle: str) -> None:
        with self._messages_lock:
            delete(self, receipt_handle)

    delete_message.serialized = True
    return delete_message


def _count_unless_in_message_op(count: property) -> property:
    def get(self: Queue) -> int:
        return 0 if getattr(_in_message_op, "on", False) else count.fget(self)

    return property(get)


def _message_op(op):
    @functools.wraps(op)
    def run(self: SQSBackend, *args, **kwargs):
        _in_message_op.on = True
        try:
            return op(self, *args, **kwargs)
        finally:
            _in_message_op.on = False

    return run


class _Visible:
    """A queue's visible messages, walked only as far as the receive reads them (and true if there is one)."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def __iter__(self):
        return (m for m in self.queue._messages if m.visible and not m.delayed)

    def __bool__(self) -> bool:
        return any(True for _ in self)


def _messages_lazily_in_message_op(messages: property) -> property:
    def get(self: Queue):
        return _Visible(self) if getattr(_in_message_op, "on", False) else messages.fget(self)

    return property(get)


def _delete_message_batch(self: SQSBackend, queue_name: str, receipts: list[dict]) -> tuple[list[str], list[dict]]:
    """Queue.delete_message for every entry (under the queue's lock, as `serialized`), in one walk of the queue."""
    queue = self.get_queue(queue_name)
    with queue._messages_lock:
        wanted = {r["ReceiptHandle"] for r in receipts} - queue.deleted_messages
        kept: list = []
        messages = queue._messages
        for i, m in enumerate(messages):
            if not wanted:  # all found: the rest stays as it is (received messages are near the front)
                kept += messages[i:]
                break
            handles = m.all_receipt_handles
            if any(h in wanted for h in handles):
                queue.pending_messages.discard(m)
                queue.deleted_messages.update(handles)
                wanted.difference_update(handles)
                continue
            kept.append(m)
        queue._messages = kept
        done = queue.deleted_messages
        return [r["Id"] for r in receipts if r["ReceiptHandle"] in done], [
            {"Id": r["Id"], "SenderFault": True, "Code": "ReceiptHandleIsInvalid",
             "Message": f'The input receipt handle "{r["ReceiptHandle"]}" is not a valid receipt handle.'}
            for r in receipts if r["ReceiptHandle"] not in done]


def patch() -> None:
    """Fix moto's SQS queues in this process (idempotent)."""
    if not getattr(Queue.delete_message, "serialized", False):
        Queue.delete_message = serialized(stock_delete_message)
    for name in COUNTS:
        if getattr(Queue, name) is stock[name]:
            setattr(Queue, name, _count_unless_in_message_op(stock[name]))
    for name in MESSAGE_OPS:
        if getattr(SQSBackend, name) is stock[name]:
            setattr(SQSBackend, name, _message_op(stock[name]))
    if Queue.messages is stock["messages"]:
        Queue.messages = _messages_lazily_in_message_op(stock["messages"])
    if SQSBackend.delete_message_batch is stock["delete_message_batch"]:
        SQSBackend.delete_message_batch = _delete_message_batch


def main(argv: list[str] | None = None) -> None:
    from moto.server import main as moto_main

    patch()
    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
