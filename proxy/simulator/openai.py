"""OpenAI's chat completions and completions as the simulator serves them (the Responses API is
`responses.py`): role chunk, content deltas on the plan's schedule, finish chunks, the usage chunk
when `stream_options.include_usage` asks for it (`"usage": null` on the others, as OpenAI sends),
`data: [DONE]`; production shapes from the `x-sim-*` headers (the package's docstring lists them).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson

from ..apis.openai import prompt_parts as prompt_parts  # noqa: F401  (what the simulator counts, as the proxy does)

if TYPE_CHECKING:
    from . import Simulator
    from .schedule import Plan


def body(kind: str, plan: "Plan", ident: str, created: int, model: str, padding: str) -> dict[str, Any]:
    """A non-streaming chat or completions body from the whole plan."""
    texts = ["".join(w for c in plan.chunks if c[1] == i and c[2] == "content" for w in c[3]) + padding for i in range(plan.choices)]
    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "length"}
                   for i, text in enumerate(texts)]
        return {"id": ident, "object": "chat.completion", "created": created, "model": model, "choices": choices, "usage": plan.usage}
    choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": "length"} for i, text in enumerate(texts)]
    return {"id": ident, "object": "text_completion", "created": created, "model": model, "choices": choices, "usage": plan.usage}


async def stream(sim: "Simulator", send: Any, kind: str, ident: str, created: int, model: str, plan: "Plan", received: float,
                 request: dict[str, Any], headers: dict[str, str]) -> None:
    cfg = sim.config
    obj_name = "chat.completion.chunk" if kind == "chat" else "text_completion"
    options = request.get("stream_options") or {}
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))  # truthy, as vLLM accepts
    continuous = include_usage and bool(options.get("continuous_usage_stats"))
    null_usage = include_usage and cfg.usage_null_chunks and not continuous
    reasoning_fields = {"both": ("reasoning_content", "reasoning")}.get(headers.get("x-sim-reasoning-field", ""), (headers.get("x-sim-reasoning-field") or "reasoning_content",))
    content_field = headers.get("x-sim-delta-field", "content")

    def event(choices: list[dict[str, Any]], usage_value: Any = None, with_usage: bool = False, metrics: Any = None) -> bytes:
        obj: dict[str, Any] = {"id": ident, "object": obj_name, "created": created, "model": model, "choices": choices}
        if with_usage or null_usage:
            obj["usage"] = usage_value
        elif continuous:
            obj["usage"] = plan.usage
        if metrics is not None:
            obj["metrics"] = metrics
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def choice(index: int, content: str | None, finish: str | None, role: bool = False, field: str = "content") -> dict[str, Any]:
        if kind != "chat":
            return {"index": index, "text": content or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif content is not None and field == "reasoning":
            delta = {name: content for name in reasoning_fields}
        elif content is not None and content_field == "function_call":
            delta = {"function_call": {"arguments": content}}
        elif content is not None:
            delta = {content_field: content}
        return {"index": index, "delta": delta, "logprobs": logprobs if content and not role else None, "finish_reason": finish}

    # x-sim-event-bytes: N: each content chunk carries `logprobs` with `top_logprobs` (as OpenAI sends
    # them with logprobs=true, top_logprobs=20) padded to about N bytes: big events, small content.
    alternatives = max(0, int(headers.get("x-sim-event-bytes", "0")) // 56)
    logprobs = ({"content": [{"token": " the", "logprob": -0.125, "bytes": [32, 116, 104, 101],
                              "top_logprobs": [{"token": " alt", "logprob": -2.5, "bytes": [32, 97, 108, 116]}] * alternatives}]}
                if alternatives else None)

    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
    if cfg.role_chunk and kind == "chat":
        for index in range(plan.choices):
            await send({"type": "http.response.body", "body": event([choice(index, None, None, role=True)]), "more_body": True})
    drop_after = int(headers.get("x-sim-drop-after", "-1"))
    stall_after = int(headers.get("x-sim-stall-after", str(cfg.stall_after)))
    error_after = int(headers.get("x-sim-stream-error-after", str(cfg.stream_error_after)))
    malformed = headers.get("x-sim-malformed") == "1"
    keepalive = float(headers.get("x-sim-keepalive-ms", "0")) / 1000
    padding = " " * int(headers.get("x-sim-token-bytes", "0"))
    sent = 0
    times = sim.stats.last_send_times = []
    batching, due = cfg.batching, 0.0
    try:
        for at, index, field, words in plan.chunks:
            if 0 <= drop_after <= sent:
                return  # leave the response incomplete: uvicorn closes the connection mid-stream
            if 0 <= stall_after <= sent:
                await asyncio.Event().wait()  # silent forever (until the client leaves)
            if 0 <= error_after <= sent:  # failed in-band, as vLLM reports an engine error once the stream began
                error = {"error": {"object": "error", "message": "simulated engine failure", "type": "InternalServerError", "param": None, "code": 500}}
                await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n", "more_body": False})
                return
            while keepalive and sent == 0 and received + at - time.monotonic() > keepalive:
                await asyncio.sleep(keepalive)
                await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
            # The batching law: the next token's time is decided by the batch as the previous one left.
            due = due + len(words) * cfg.batch_gap_s(sim.decoding) if batching and sent else received + at
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            before = time.monotonic()
            await send({"type": "http.response.body", "body": event([choice(index, "".join(words) + padding, None, field=field)]), "more_body": True})
            sim.stats.tokens_sent += len(words)
            times.append((before, time.monotonic()))
            if malformed and sent == 0:
                await send({"type": "http.response.body", "body": b'data: {"choices": [{"delta": {"content": "unterminated\n\n', "more_body": True})
            if sent == 0:
                sim.decoding += 1
            sent += 1
    finally:
        if sent:
            sim.decoding -= 1
    tail = b"".join(event([choice(index, None, "length")]) for index in range(plan.choices))
    if include_usage:
        metrics = plan.vllm_metrics() if headers.get("x-sim-vllm-metrics") == "1" else None
        tail += event([], plan.usage, with_usage=True, metrics=metrics)
    done_gap = float(headers.get("x-sim-done-gap-ms", "0")) / 1000
    await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": done_gap > 0})
    if done_gap:  # the end of the response a little after [DONE], as llama.cpp's server sends it
        await asyncio.sleep(done_gap)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    sim.stats.completed += 1
