"""OpenAI's Responses API (/v1/responses): items in and out, its SSE event sequence, usage with cached tokens.

Limits, auth, rate-limit headers and error shapes are chat completions' (the same organisation and model
buckets: the route is "openai" for the limiter and the prompt cache). Stateless: a request carries its whole
conversation (as Codex CLI sends it, with store=false); previous_response_id is refused.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from simulator.policy import Conversation, Reply
from simulator.tokens import Billing, Prompt
from simulator.wire import (
    BadRequest,
    Call,
    Frame,
    new_id,
    offered,
    piece_tokens,
    pieces,
    require,
    sse,
    text_of,
    tools,
)
from simulator.wire_openai import OpenAIWire

# items a model wrote: a run of them in the input is one earlier turn
_OUTPUT_ITEMS = {"function_call", "reasoning", "custom_tool_call", "local_shell_call"}


def _usage(billing: Billing) -> dict:
    prompt = billing.prompt_tokens  # cached tokens included, as OpenAI counts them
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": billing.cached_tokens},
        "output_tokens": billing.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + billing.output_tokens,
    }


def _turns(items: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """Input items as (role, text): a run of items the model wrote is one assistant turn; tool outputs are not
    turns of either side."""
    turns: list[tuple[str, str]] = []
    inside = False
    for item in items:
        out = item.get("role") == "assistant" or item.get("type") in _OUTPUT_ITEMS
        if out and not inside:
            turns.append(("assistant", text_of(item.get("content"))))
        elif item.get("role") == "user":
            turns.append(("user", text_of(item.get("content"))))
        inside = out
    return tuple(turns)


class ResponsesWire(OpenAIWire):
    def parse(self, body: Any) -> Call:
        model = require(body, "model", str)
        raw = require(body, "input", (str, list))
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
        if not all(isinstance(i, dict) for i in items):
            raise BadRequest("input: each item must be an object")
        if body.get("previous_response_id"):
            raise BadRequest("previous_response_id: not supported here; send the whole conversation as input")
        max_tokens = body.get("max_output_tokens")
        preamble = {k: body[k] for k in ("instructions", "tools") if body.get(k)}
        return Call(
            model=model,
            stream=bool(body.get("stream")),
            include_usage=False,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            prompt=Prompt.of(preamble or None, items),
            conversation=Conversation(
                turns=_turns(items),
                tools=offered([(t.get("name"), t.get("parameters")) for t in tools(body) if t.get("type") == "function"]),
                system="\n".join([text_of(body.get("instructions"))] + [
                    text_of(i.get("content")) for i in items if i.get("role") in ("system", "developer")]),
            ),
        )

    @staticmethod
    def _response(call: Call, rid: str, created: int, status: str, output: list, usage: dict | None) -> dict:
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "instructions": None, "max_output_tokens": call.max_tokens,
            "model": call.model, "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": 1.0,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "truncation": "disabled", "usage": usage, "user": None, "metadata": {},
        }

    @staticmethod
    def _items(call: Call, reply: Reply) -> list[dict]:
        items: list[dict] = [{
            "id": new_id("msg_"), "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": reply.text, "annotations": [], "logprobs": []}],
        }]
        if reply.call is not None:
            items.append({"id": new_id("fc_"), "type": "function_call", "status": "completed",
                          "call_id": new_id("call_"), "name": reply.call.name, "arguments": reply.call.arguments})
        return items

    def message(self, call: Call, reply: Reply, billing: Billing) -> dict:
        return self._response(call, new_id("resp_"), int(time.time()), "completed", self._items(call, reply),
                              _usage(billing))

    def frames(self, call: Call, reply: Reply, billing: Billing) -> list[Frame]:
        rid, created, seq = new_id("resp_"), int(time.time()), itertools.count()

        def ev(kind: str, tokens: float = 0.0, **fields: Any) -> Frame:
            return Frame(sse({"type": kind, "sequence_number": next(seq), **fields}, kind), tokens)

        start = self._response(call, rid, created, "in_progress", [], None)
        frames = [ev("response.created", response=start), ev("response.in_progress", response=start)]
        items = self._items(call, reply)
        msg, part = items[0], {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        at = {"item_id": msg["id"], "output_index": 0, "content_index": 0}
        frames += [
            ev("response.output_item.added", output_index=0, item={**msg, "status": "in_progress", "content": []}),
            ev("response.content_part.added", **at, part=part),
            *(ev("response.output_text.delta", piece_tokens(p), **at, delta=p, logprobs=[]) for p in pieces(reply.text)),
            ev("response.output_text.done", **at, text=reply.text, logprobs=[]),
            ev("response.content_part.done", **at, part={**part, "text": reply.text}),
            ev("response.output_item.done", output_index=0, item=msg),
        ]
        if len(items) > 1:
            fc = items[1]
            at = {"item_id": fc["id"], "output_index": 1}
            frames += [
                ev("response.output_item.added", output_index=1, item={**fc, "status": "in_progress", "arguments": ""}),
                *(ev("response.function_call_arguments.delta", piece_tokens(p), **at, delta=p)
                  for p in pieces(fc["arguments"])),
                ev("response.function_call_arguments.done", **at, name=fc["name"], arguments=fc["arguments"]),
                ev("response.output_item.done", output_index=1, item=fc),
            ]
        frames.append(ev("response.completed",
                         response=self._response(call, rid, created, "completed", items, _usage(billing))))
        return frames

    def stream_error(self) -> bytes:
        doc = {"type": "error", "code": "server_is_overloaded", "message": "Overloaded", "param": None,
               "sequence_number": 0}
        return sse(doc, event="error")
