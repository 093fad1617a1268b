"""What the results writer accepts, and what it dead-letters instead.

- On the results queue: ledger batches and attempt results only, each signed with the key of the attempt it names
  (contract.signing.attempt_key), every ledger row in it naming that same attempt. A verdict there is refused: a
  task can send to that queue.
- On the verdict queue: verdicts only, signed with the verdict key (the eval fleet's; IAM lets only the eval role
  send to that queue on AWS).
- Anything naming another run is refused.

A refused message goes to the run's results dead-letter queue at once, with the reason as a message attribute, and
is logged; it never lands.
"""

from __future__ import annotations

import logging
from typing import Any

from contract import signing
from contract.signing import REJECTED_ATTRIBUTE, SIG_ATTRIBUTE, RunKeys
from dispatcher.backends.resources import RunResources

log = logging.getLogger("evalplane.writer")

RECEIVE_ATTRIBUTES = [SIG_ATTRIBUTE]  # MessageAttributeNames for receive_message


def signature_of(message: dict[str, Any]) -> str | None:
    """The signature an SQS message (as receive_message returns it) carries, if any."""
    return (message.get("MessageAttributes") or {}).get(SIG_ATTRIBUTE, {}).get("StringValue")


def rows_of_other_attempts(ref, rows: list[dict[str, Any]]) -> int:
    return sum(1 for r in rows if (r.get("run"), r.get("instance_id"), r.get("attempt"))
               != (ref.run, ref.instance_id, ref.attempt))


class MessageAuth:
    def __init__(self, res: RunResources, keys: RunKeys):
        self.res, self.keys = res, keys

    def refusal(self, queue_url: str, body: str | bytes, signature: str | None, incoming) -> str | None:
        """None if the message (decoded as `incoming`, a writer.Incoming) may land; else why not."""
        msg = incoming.msg
        ref = msg.ref
        if ref.run != self.res.run:
            return f"names run {ref.run!r}, not {self.res.run!r}"
        if queue_url == self.res.verdict_queue_url:
            if msg.kind != "verdict":
                return f"a {msg.kind} message on the verdict queue"
            if not signing.verify(self.keys.verdict_key, body, signature):
                return f"verdict for {ref.slug} not signed with the verdict key"
            return None
        if msg.kind == "verdict":
            return f"a verdict for {ref.slug} on the results queue (verdicts come only on the verdict queue)"
        return self.attempt_refusal(body, signature, incoming)

    def attempt_refusal(self, body: str | bytes, signature: str | None, incoming) -> str | None:
        """A task's message (or its S3 copy): signed with its attempt's key, every row its own attempt's."""
        ref = incoming.msg.ref
        if not signing.verify(self.keys.attempt_key(ref), body, signature):
            return f"{incoming.msg.kind} for {ref.slug} not signed with that attempt's key"
        if n := rows_of_other_attempts(ref, incoming.rows):
            return f"{incoming.msg.kind} for {ref.slug} carries {n} ledger rows of other attempts"
        return None

    def dead_letter(self, sqs, queue_url: str, refused: list[tuple[dict[str, Any], str]]) -> None:
        """Move refused messages to the results dead-letter queue now (reason attached), then off their queue."""
        for m, why in refused:
            log.error("message %s refused, dead-lettered: %s", m.get("MessageId"), why)
            sqs.send_message(QueueUrl=self.res.results_dlq_url, MessageBody=m["Body"],
                             MessageAttributes={REJECTED_ATTRIBUTE: {"DataType": "String", "StringValue": why[:1000]}})
        for i in range(0, len(refused), 10):
            sqs.delete_message_batch(QueueUrl=queue_url, Entries=[
                {"Id": str(j), "ReceiptHandle": m["ReceiptHandle"]} for j, (m, _) in enumerate(refused[i:i + 10])])
