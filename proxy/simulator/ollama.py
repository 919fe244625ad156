"""Ollama's `/api/chat`, `/api/generate` and `/api/embed` as the simulator serves them, on the same
schedule and `x-sim-*` headers as chat: NDJSON, one object per chunk (`message.content`, or
`message.thinking` for visible reasoning; `response` / `thinking` for generate), then the last
object (`done: true`) with the counts and the engine timings in ns, from the schedule:
`load_duration` (`x-sim-load-ms`: a cold model load before prefill), `prompt_eval_duration` (the
prefill), `eval_duration` (first token to last), `total_duration`. `x-sim-stream-error: 1` sends an
`{"error": …}` line after the last chunk. `GET /api/tags` lists one model.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson

from ..apis.ollama import Ollama

if TYPE_CHECKING:
    from .schedule import Plan

prompt_parts = Ollama().prompt_parts
CREATED = "2026-01-01T00:00:00.000000000Z"
TAGS = {"models": [{"name": "sim-7b:latest", "model": "sim-7b:latest", "size": 4_000_000_000, "digest": "0" * 64,
                    "details": {"format": "gguf", "family": "llama", "parameter_size": "7B", "quantization_level": "Q4_K_M"}}]}


def _line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj) + b"\n"


def _delta(kind: str, model: str, field: str, text: str) -> dict[str, Any]:
    if kind == "ollama_chat":
        message: dict[str, Any] = {"role": "assistant", "content": "" if field == "reasoning" else text}
        if field == "reasoning":
            message["thinking"] = text
        return {"model": model, "created_at": CREATED, "message": message, "done": False}
    return {"model": model, "created_at": CREATED, "response": "" if field == "reasoning" else text, "done": False,
            **({"thinking": text} if field == "reasoning" else {})}


def final(kind: str, plan: "Plan", model: str, text: str = "") -> dict[str, Any]:
    """The last object: counts and the engine's timings (ns), from the schedule."""
    first = plan.chunks[0][0] if plan.chunks else plan.first
    ns = lambda s: int(max(0.0, s) * 1e9)  # noqa: E731
    obj = _delta(kind, model, "content", text)
    obj.update(done=True, done_reason="length", total_duration=ns(plan.end), load_duration=ns(plan.load),
               prompt_eval_count=plan.usage["prompt_tokens"], prompt_eval_duration=ns(plan.first - plan.queue),
               eval_count=plan.usage["completion_tokens"], eval_duration=ns(plan.end - first))
    return obj


async def stream(send: Any, kind: str, plan: "Plan", received: float, model: str, headers: dict[str, str],
                 times: list[tuple[float, float]]) -> int:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]})
    sent = 0
    for at, _, field, words in plan.chunks:
        await asyncio.sleep(max(0.0, received + at - time.monotonic()))
        before = time.monotonic()
        await send({"type": "http.response.body", "body": _line(_delta(kind, model, field, "".join(words))), "more_body": True})
        sent += len(words)
        times.append((before, time.monotonic()))
    if headers.get("x-sim-stream-error") == "1":
        await send({"type": "http.response.body", "body": _line({"error": "simulated failure"}), "more_body": False})
        return sent
    await send({"type": "http.response.body", "body": _line(final(kind, plan, model)), "more_body": False})
    return sent


def body(kind: str, plan: "Plan", model: str) -> dict[str, Any]:
    text = "".join(w for c in plan.chunks if c[2] == "content" for w in c[3])
    obj = final(kind, plan, model, text)
    thinking = "".join(w for c in plan.chunks if c[2] == "reasoning" for w in c[3])
    if thinking:
        (obj["message"] if kind == "ollama_chat" else obj)["thinking"] = thinking
    return obj


def embed(request: dict[str, Any], tokens: int, load_s: float) -> dict[str, Any]:
    inputs = request.get("input")
    items = inputs if isinstance(inputs, list) else [inputs]
    return {"model": request.get("model", ""), "embeddings": [[round(0.01 * (i + j), 4) for j in range(8)] for i in range(len(items))],
            "total_duration": int(load_s * 1e9) + 1_000_000, "load_duration": int(load_s * 1e9), "prompt_eval_count": tokens}
