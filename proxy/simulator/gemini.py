"""Gemini's `:generateContent` / `:streamGenerateContent` as the simulator serves them, on the same
schedule and `x-sim-*` headers as chat: each chunk a `GenerateContentResponse` with the chunk's
text part (`thought: true` for visible reasoning), the cumulative `usageMetadata` (hidden reasoning
in `thoughtsTokenCount` only) and `modelVersion`; the last one with `finishReason: MAX_TOKENS`.
With `?alt=sse` the stream is SSE (`data: …\\r\\n\\r\\n`, as Google sends it), otherwise one JSON
array written element by element. `x-sim-stream-error: 1` ends it with an `error` object.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson

from ..apis.gemini import Gemini

if TYPE_CHECKING:
    from .schedule import Plan

prompt_parts = Gemini().prompt_parts


def usage(plan: "Plan", output: int) -> dict[str, Any]:
    chat = plan.usage
    out = {"promptTokenCount": chat["prompt_tokens"], "candidatesTokenCount": output, "totalTokenCount": chat["prompt_tokens"] + output}
    if plan.cached:
        out["cachedContentTokenCount"] = plan.cached
    if plan.thinking_tokens:
        out["thoughtsTokenCount"] = plan.thinking_tokens
        out["totalTokenCount"] += plan.thinking_tokens
    return out


def response(plan: "Plan", model: str, ident: str, parts: list[dict[str, Any]], output: int, finish: str | None) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate], "usageMetadata": usage(plan, output), "modelVersion": model, "responseId": ident}


async def stream(send: Any, plan: "Plan", received: float, ident: str, model: str, headers: dict[str, str], sse: bool,
                 times: list[tuple[float, float]]) -> int:
    content_type = b"text/event-stream" if sse else b"application/json; charset=UTF-8"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
    frame = (lambda obj, first: b"data: " + orjson.dumps(obj) + b"\r\n\r\n") if sse else \
        (lambda obj, first: (b"[" if first else b",\r\n") + orjson.dumps(obj))
    sent, visible, last = 0, 0, len(plan.chunks) - 1
    for k, (at, _, field, words) in enumerate(plan.chunks):
        await asyncio.sleep(max(0.0, received + at - time.monotonic()))
        before = time.monotonic()
        part: dict[str, Any] = {"text": "".join(words)}
        if field == "reasoning":
            part["thought"] = True
        else:
            visible += len(words)
        await send({"type": "http.response.body", "body": frame(response(plan, model, ident, [part], visible, "MAX_TOKENS" if k == last else None),
                                                                k == 0), "more_body": True})
        sent += len(words)
        times.append((before, time.monotonic()))
    tail = b""
    if headers.get("x-sim-stream-error") == "1":
        tail = frame({"error": {"code": 500, "message": "simulated failure", "status": "INTERNAL"}}, False)
    await send({"type": "http.response.body", "body": tail + (b"" if sse else b"]"), "more_body": False})
    return sent


def body(plan: "Plan", ident: str, model: str) -> dict[str, Any]:
    thought = "".join(w for c in plan.chunks if c[2] == "reasoning" for w in c[3])
    text = "".join(w for c in plan.chunks if c[2] == "content" for w in c[3])
    parts = ([{"text": thought, "thought": True}] if thought else []) + [{"text": text}]
    return response(plan, model, ident, parts, sum(len(c[3]) for c in plan.chunks if c[2] == "content"), "MAX_TOKENS")
