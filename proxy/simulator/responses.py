"""The Responses API (`POST /v1/responses`) as the simulator serves it, on the same schedule as chat.

A stream is typed SSE events (`event: <type>` and a JSON payload carrying the same `type`), in the
order OpenAI sends them and the official client's `responses.stream()` helper checks:
`response.created`, `response.in_progress`; per output item `response.output_item.added` (and its
content or summary part), its deltas, its `*.done` events and `response.output_item.done`; then
`response.completed` with the whole response and its usage. Output items follow the plan: visible
reasoning (`reasoning_text` deltas, as vLLM streams it, or `reasoning_summary_text` with
`x-sim-reasoning-field: summary`, as OpenAI does), then a message, or a function call's arguments
(`x-sim-delta-field: function_call`). Hidden reasoning and cached prompt tokens appear in usage only.
`x-sim-response-failed: 1` ends the stream with `response.failed` instead of `response.completed`.
Structural events go out in the same write as the delta they precede, so they never move a
token's time.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import orjson


def usage(chat: dict[str, Any]) -> dict[str, Any]:
    """The plan's chat-shaped usage in the Responses API's shape."""
    details = chat.get("prompt_tokens_details") or {}
    completion = chat.get("completion_tokens_details") or {}
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": completion.get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


def response(ident: str, created: int, model: str, status: str, output: list[dict[str, Any]], used: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": ident, "object": "response", "created_at": created, "status": status, "model": model, "output": output,
            "usage": used, "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}}


class Items:
    """The output items of one response, built as its chunks go out."""

    def __init__(self, ident: str, tool: bool, summary: bool) -> None:
        self.ident, self.tool, self.summary = ident, tool, summary
        self.done: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": self.sequence, **fields}) + b"\n\n"

    def _item(self, field: str) -> dict[str, Any]:
        index = len(self.done)
        if field == "reasoning":
            return {"type": "reasoning", "id": f"rs_{self.ident}_{index}", "summary": [], "content": [] if self.summary else None}
        if self.tool:
            return {"type": "function_call", "id": f"fc_{self.ident}_{index}", "call_id": f"call_{index}", "name": "lookup",
                    "arguments": "", "status": "in_progress"}
        return {"type": "message", "id": f"msg_{self.ident}_{index}", "role": "assistant", "status": "in_progress", "content": []}

    def delta(self, field: str, text: str) -> bytes:
        """The events for one chunk: opening (and closing the previous) item as needed, then its delta."""
        out = b""
        kind = "reasoning" if field == "reasoning" else "content"
        if self.open is not None and (self.open["type"] == "reasoning") != (kind == "reasoning"):
            out += self.close()
        if self.open is None:
            self.open, self.text = self._item(field), ""
            index = len(self.done)
            out += self.event("response.output_item.added", output_index=index, item=self.open)
            if self.open["type"] == "message":
                out += self.event("response.content_part.added", item_id=self.open["id"], output_index=index, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []})
            elif self.open["type"] == "reasoning" and self.summary:
                out += self.event("response.reasoning_summary_part.added", item_id=self.open["id"], output_index=index,
                                  summary_index=0, part={"type": "summary_text", "text": ""})
        self.text += text
        index, item_id = len(self.done), self.open["id"]
        if self.open["type"] == "function_call":
            return out + self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=text)
        if self.open["type"] == "reasoning":
            if self.summary:
                return out + self.event("response.reasoning_summary_text.delta", item_id=item_id, output_index=index, summary_index=0, delta=text)
            return out + self.event("response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text)
        return out + self.event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text, logprobs=[])

    def close(self) -> bytes:
        item, index, text = self.open, len(self.done), self.text
        if item is None:
            return b""
        self.open = None
        out = b""
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            out += self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text, logprobs=[])
            out += self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
            item = {**item, "status": "completed", "content": [part]}
        elif item["type"] == "function_call":
            out += self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=text)
            item = {**item, "status": "completed", "arguments": text}
        elif self.summary:
            out += self.event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index, summary_index=0, text=text)
            item = {**item, "summary": [{"type": "summary_text", "text": text}]}
        else:
            out += self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text)
            item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
        self.done.append(item)
        return out + self.event("response.output_item.done", output_index=index, item=item)


async def stream(send: Callable[[dict[str, Any]], Any], plan: Any, received: float, ident: str, created: int, model: str,
                 headers: dict[str, str], times: list[tuple[float, float]] | None = None) -> int:
    """Send the whole event stream on the plan's schedule; returns the tokens sent."""
    items = Items(ident, headers.get("x-sim-delta-field") == "function_call", headers.get("x-sim-reasoning-field") == "summary")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
    start = response(ident, created, model, "in_progress", [], None)
    await send({"type": "http.response.body", "more_body": True,
                "body": items.event("response.created", response=start) + items.event("response.in_progress", response=start)})
    sent = 0
    for at, _, field, words in plan.chunks:
        await asyncio.sleep(max(0.0, received + at - time.monotonic()))
        before = time.monotonic()
        await send({"type": "http.response.body", "body": items.delta(field, "".join(words)), "more_body": True})
        sent += len(words)
        if times is not None:
            times.append((before, time.monotonic()))
    tail = items.close()
    if headers.get("x-sim-response-failed") == "1":  # the generation failed after its last delta
        failed = {**response(ident, created, model, "failed", items.done, None), "error": {"code": "server_error", "message": "simulated failure"}}
        await send({"type": "http.response.body", "body": tail + items.event("response.failed", response=failed), "more_body": False})
        return sent
    final = response(ident, created, model, "completed", items.done, usage(plan.usage))
    await send({"type": "http.response.body", "body": tail + items.event("response.completed", response=final), "more_body": False})
    return sent


def body(plan: Any, ident: str, created: int, model: str, headers: dict[str, str]) -> dict[str, Any]:
    """The non-streaming response: the same items, built from the whole plan at once."""
    items = Items(ident, headers.get("x-sim-delta-field") == "function_call", headers.get("x-sim-reasoning-field") == "summary")
    for _, _, field, words in plan.chunks:
        items.delta(field, "".join(words))
    items.close()
    return response(ident, created, model, "completed", items.done, usage(plan.usage))
