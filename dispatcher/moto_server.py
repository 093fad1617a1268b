"""moto's server as the local S3/SQS stand-in, with one defect of its SQS queue fixed: `python -m dispatcher.moto_server
-H HOST -p PORT` (moto_server's own arguments).

moto serves each request on its own thread, and its Queue.delete_message rebuilds the queue's message list from a
snapshot without the lock SendMessage appends under. A message sent while a delete is rebuilding the list (two
writers deleting at once widen the window to a whole rebuild) is dropped: SendMessage answered with its MessageId,
the message is in neither the queue nor its dead-letter queue. Here the rebuild runs under that same lock.
tests/dispatcher/test_results_send.py reproduces the loss on the stock method and shows it gone.
"""

from __future__ import annotations

import functools
import sys

from moto.sqs.models import Queue

stock_delete_message = Queue.delete_message


def serialized(delete):
    """Queue.delete_message under the queue's own message lock (the Condition add_message holds)."""

    @functools.wraps(delete)
    def delete_message(self: Queue, receipt_handle: str) -> None:
        with self._messages_lock:
            delete(self, receipt_handle)

    delete_message.serialized = True
    return delete_message


def patch() -> None:
    """Fix moto's SQS queues in this process (idempotent)."""
    if not getattr(Queue.delete_message, "serialized", False):
        Queue.delete_message = serialized(stock_delete_message)


def main(argv: list[str] | None = None) -> None:
    from moto.server import main as moto_main

    patch()
    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
