"""Ollama's own API (`ollama.Client(host=<proxy>)`): `POST /api/chat` and `/api/generate` (NDJSON
streams: one JSON object per line; `stream` defaults to true there), `/api/embed` (and the older
`/api/embeddings`) timed as embeddings; `/api/tags`, `/api/show`, `/api/ps` and the rest relayed
untimed (`ollama_other`).

Content is `message.content` (chat) or `response` (generate); `message.thinking` / `thinking` is
visible reasoning; `message.tool_calls` carry a call's arguments (an object, counted as its JSON).
The last object (`"done": true`) has the counts, `prompt_eval_count` (the prompt tokens evaluated:
a prompt Ollama found cached is not re-evaluated) and `eval_count`, and the engine's own timings
in ns, joined like llama.cpp's: `prompt_eval_duration` is its prefill, `eval_duration / eval_count`
its time per token, `load_duration` its model load: the phase `load`, carved out of what the proxy
saw before the first token (a cold model load is the first thing to see on a laptop). An
`{"error": …}` object, mid-stream or alone, fails the request.
"""
from __future__ import annotations

from typing import Any


from ..wire.chunk import BodyInfo, Chunk, count, listed, string
from ..wire.engine import from_ollama
from ..wire.text import json_text
from ..wire.tokens import REPLY_PRIMING, TOKENS_PER_MESSAGE, Parts, PromptParts
from . import Dialect, Route

ENDPOINTS = {"/api/chat": "ollama_chat", "/api/generate": "ollama_generate", "/api/embed": "ollama_embed", "/api/embeddings": "ollama_embed"}


class Ollama(Dialect):
    name = "ollama"
    provider = "ollama"

    def route(self, path: str, query: bytes = b"") -> Route | None:
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            return Route(self, endpoint, framing="ndjson")
        if path.startswith("/api/"):
            return Route(self, "ollama_other", timed=False)
        return None

    def model_and_stream(self, endpoint: str, parsed: dict[str, Any]) -> tuple[str, bool]:
        return string(parsed.get("model")), endpoint != "ollama_embed" and parsed.get("stream") is not False

    def prompt_parts(self, endpoint: str, parsed: dict[str, Any]) -> PromptParts:
        parts = Parts(string(parsed.get("model")))
        if endpoint == "ollama_chat":
            parts.fixed = REPLY_PRIMING
            for message in listed(parsed.get("messages")):
                if isinstance(message, dict):
                    parts.fixed += TOKENS_PER_MESSAGE
                    parts.value(message.get("role"))
                    parts.value(message.get("content"))
                    parts.uncounted += len(listed(message.get("images")))
            if isinstance(parsed.get("tools"), list) and parsed["tools"]:
                parts.texts.append(json_text(parsed["tools"]))
        else:
            parts.value(parsed.get("system"))
            parts.input(parsed.get("prompt") if endpoint == "ollama_generate" else parsed.get("input"))
            parts.uncounted += len(listed(parsed.get("images")))
        return parts.done()

    def read(self, obj: dict[str, Any], chunk: Chunk) -> None:
        read(obj, chunk)

    def body(self, obj: dict[str, Any]) -> BodyInfo:
        chunk = Chunk()
        read(obj, chunk)
        if "embeddings" in obj or "embedding" in obj:
            chunk.usage = {"prompt_tokens": count(obj, "prompt_eval_count")} if count(obj, "prompt_eval_count") is not None else None
        return BodyInfo(chunk.usage, chunk.model, chunk.text, engine=chunk.engine)


def read(obj: dict[str, Any], chunk: Chunk) -> None:
    """One NDJSON object (or a whole body): its text, reasoning, counts and timings."""
    if "error" in obj:
        chunk.failed = "error"
        return
    message = obj.get("message")
    source = message if isinstance(message, dict) else obj
    text = string(source.get("content") if message is not None else obj.get("response"))
    thinking = string(source.get("thinking"))
    calls = source.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                text += json_text(fn.get("arguments") or {})
    if thinking or text:
        chunk.texts.append((0, thinking + text))
        chunk.reasoning = bool(thinking)
    chunk.model = string(obj.get("model"))
    if obj.get("done") is True:
        chunk.final = True
        prompt, output = count(obj, "prompt_eval_count"), count(obj, "eval_count")
        if prompt is not None or output is not None:
            chunk.usage = {key: value for key, value in (("prompt_tokens", prompt), ("completion_tokens", output)) if value is not None}
        chunk.engine = from_ollama(obj)
