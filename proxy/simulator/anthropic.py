"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as the simulator
serves it, on the same schedule and `x-sim-*` headers as chat.

A stream is the event sequence Anthropic sends and the official SDK's `messages.stream()` helper
accumulates: `message_start` (input usage: `input_tokens` is the uncached part,
`cache_read_input_tokens` the `x-sim-cached-tokens`), `ping`, then per content block
`content_block_start`, its deltas, `content_block_stop`; `message_delta` with the stop reason and
the cumulative `output_tokens` (with `output_tokens_details.thinking_tokens` when there was
reasoning), `message_stop`. Blocks follow the plan: visible reasoning as a `thinking` block
(`thinking_delta`, closed by a `signature_delta`), then `text`, or a `tool_use` block streaming
`input_json_delta` (`x-sim-delta-field: function_call`). Hidden reasoning
(`x-sim-hidden-reasoning`) is a `redacted_thinking` block, sent whole before the first delta.
`x-sim-keepalive-ms` sends `ping` events before the first token; `x-sim-stream-error: 1` ends the
stream with an `error` event (`overloaded_error`) after the last delta. Structural events go out in
the same write as the delta they precede, so they never move a token's time.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson

from ..apis.anthropic import Anthropic

if TYPE_CHECKING:
    from .schedule import Plan

DIALECT = Anthropic()
prompt_parts = DIALECT.prompt_parts


def event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def usage(plan: "Plan", output: int | None = None) -> dict[str, Any]:
    chat = plan.usage
    out: dict[str, Any] = {"input_tokens": chat["prompt_tokens"] - plan.cached, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": plan.cached, "output_tokens": chat["completion_tokens"] if output is None else output}
    if output is None and plan.thinking_tokens:
        out["output_tokens_details"] = {"thinking_tokens": plan.thinking_tokens}
    return out


def message(ident: str, model: str, content: list[dict[str, Any]], stop: str | None, used: dict[str, Any]) -> dict[str, Any]:
    return {"id": ident, "type": "message", "role": "assistant", "model": model, "content": content, "stop_reason": stop,
            "stop_sequence": None, "usage": used}


class Blocks:
    """The content blocks of one message, opened and closed as its chunks go out."""

    def __init__(self, ident: str, tool: bool) -> None:
        self.ident, self.tool = ident, tool
        self.done: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""

    def redacted(self) -> bytes:
        block = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"}
        index = len(self.done)
        self.done.append(block)
        return event("content_block_start", index=index, content_block=block) + event("content_block_stop", index=index)

    def delta(self, field: str, text: str) -> bytes:
        kind = "thinking" if field == "reasoning" else ("tool_use" if self.tool else "text")
        out = b""
        if self.open is not None and self.open["type"] != kind:
            out += self.close()
        if self.open is None:
            starts: dict[str, dict[str, Any]] = {
                "thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""},
                "tool_use": {"type": "tool_use", "id": f"toolu_{self.ident}", "name": "lookup", "input": {}}}
            start = starts[kind]
            self.open, self.text = start, ""
            out += event("content_block_start", index=len(self.done), content_block=start)
        self.text += text
        delta = {"thinking": {"type": "thinking_delta", "thinking": text}, "text": {"type": "text_delta", "text": text},
                 "tool_use": {"type": "input_json_delta", "partial_json": text}}[kind]
        return out + event("content_block_delta", index=len(self.done), delta=delta)

    def close(self) -> bytes:
        block, index = self.open, len(self.done)
        if block is None:
            return b""
        self.open = None
        out = b""
        if block["type"] == "thinking":
            out += event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"})
            block = {**block, "thinking": self.text, "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"}
        elif block["type"] == "text":
            block = {**block, "text": self.text}
        else:
            block = {**block, "input": orjson.loads(self.text) if self.text.endswith("}") else {"q": self.text}}
        self.done.append(block)
        return out + event("content_block_stop", index=index)


def tool_text(words: list[str], first: bool, last: bool) -> str:
    """Tool-input JSON fragments that parse as a whole: `{"q": "` + the words + `"}`."""
    return ('{"q": "' if first else "") + "".join(words) + ('"}' if last else "")


async def stream(send: Any, plan: "Plan", received: float, ident: str, model: str, headers: dict[str, str],
                 times: list[tuple[float, float]]) -> int:
    """Send the whole event stream on the plan's schedule; returns the tokens sent."""
    blocks = Blocks(ident, headers.get("x-sim-delta-field") == "function_call")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
    start = message(ident, model, [], None, usage(plan, output=1))
    await send({"type": "http.response.body", "body": event("message_start", message=start) + event("ping"), "more_body": True})
    keepalive = float(headers.get("x-sim-keepalive-ms", "0")) / 1000
    sent, last = 0, len(plan.chunks) - 1
    for k, (at, _, field, words) in enumerate(plan.chunks):
        while keepalive and sent == 0 and received + at - time.monotonic() > keepalive:
            await asyncio.sleep(keepalive)
            await send({"type": "http.response.body", "body": event("ping"), "more_body": True})
        await asyncio.sleep(max(0.0, received + at - time.monotonic()))
        before = time.monotonic()
        out = blocks.redacted() if sent == 0 and plan.hidden else b""
        text = tool_text(words, blocks.open is None or blocks.open["type"] != "tool_use", k == last) if blocks.tool and field != "reasoning" \
            else "".join(words)
        await send({"type": "http.response.body", "body": out + blocks.delta(field, text), "more_body": True})
        sent += len(words)
        times.append((before, time.monotonic()))
    tail = blocks.close()
    if headers.get("x-sim-stream-error") == "1":
        error = {"type": "overloaded_error", "message": "Overloaded"}
        await send({"type": "http.response.body", "body": tail + event("error", error=error), "more_body": False})
        return sent
    tail += event("message_delta", delta={"stop_reason": "tool_use" if blocks.tool else "max_tokens", "stop_sequence": None},
                  usage=usage(plan))
    await send({"type": "http.response.body", "body": tail + event("message_stop"), "more_body": False})
    return sent


def body(plan: "Plan", ident: str, model: str, headers: dict[str, str]) -> dict[str, Any]:
    """The non-streaming response: the same blocks, built from the whole plan at once."""
    blocks = Blocks(ident, headers.get("x-sim-delta-field") == "function_call")
    if plan.hidden:
        blocks.redacted()
    for _, _, field, words in plan.chunks:
        blocks.delta(field, "".join(words))
    blocks.close()
    return message(ident, model, blocks.done, "tool_use" if blocks.tool else "max_tokens", usage(plan))
