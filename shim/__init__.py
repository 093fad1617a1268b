"""The per-task model-call shim: a loopback proxy between a harness and the gateway.

It swaps the harness's local token for the real upstream key, forwards the OpenAI (chat completions and
Responses) and Anthropic wire formats, streaming or not, absorbs rate-limit and overload errors with retries,
meters every call into a ledger (JSONL + SQS batches), enforces turn and dollar caps, paces the pool, and
publishes progress. Guide: docs/shim.md.
"""
