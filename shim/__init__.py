"""The per-task model-call shim: a loopback proxy between a harness and the gateway.

It swaps the harness's local token for the real upstream key, forwards OpenAI and Anthropic
wire formats (streaming or not), absorbs rate-limit and overload errors with retries, meters every
call into a ledger (JSONL + SQS batches), enforces turn and dollar caps, and publishes progress.
"""

from shim.config import ShimConfig

__all__ = ["ShimConfig"]
