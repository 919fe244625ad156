"""What one SSE data payload means for timing: content, usage, or neither.

A content chunk carries generated text: `choices[].delta.content`, `delta.reasoning_content` /
`delta.reasoning` (reasoning models emit these tokens first), tool-call `function.arguments`, or
`choices[].text` (completions). Role-only chunks, finish-only chunks and the usage-only chunk
(`choices: []` plus `usage`) are not content.
"""
from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import orjson

DONE = b"[DONE]"


class Chunk:
    __slots__ = ("text", "usage", "model", "usage_only", "valid", "timings")

    def __init__(self) -> None:
        self.text: str = ""  # generated text in this chunk ("" = not a content chunk)
        self.usage: dict[str, Any] | None = None
        self.model: str = ""
        self.usage_only: bool = False
        self.valid: bool = True
        self.timings: dict[str, Any] | None = None  # engine-reported per-request timings (llama.cpp)


def _delta_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if delta is None:
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    if not isinstance(delta, dict):
        return ""
    parts = []
    for key in ("content", "reasoning_content", "reasoning"):
        value = delta.get(key)
        if isinstance(value, str) and value:
            parts.append(value)
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str) and args:
                parts.append(args)
    return "".join(parts)


def parse_chunk(data: bytes) -> Chunk:
    chunk = Chunk()
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        chunk.valid = False
        return chunk
    if not isinstance(obj, dict):
        chunk.valid = False
        return chunk
    choices = obj.get("choices")
    if isinstance(choices, list):
        texts = [_delta_text(c) for c in choices if isinstance(c, dict)]
        chunk.text = "".join(texts)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        chunk.usage = usage
        chunk.usage_only = choices == []
    model = obj.get("model")
    if isinstance(model, str):
        chunk.model = model
    timings = obj.get("timings")
    if isinstance(timings, dict):
        chunk.timings = timings
    return chunk


def read_usage(usage: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) from an OpenAI usage object, None where absent."""
    if not usage:
        return None, None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) else None, completion if isinstance(completion, int) else None)


def strip_usage_null(raw: bytes) -> bytes:
    """Remove the `"usage":null` key that include_usage adds to every chunk (OpenAI does)."""
    if b'"usage":null' not in raw:
        return raw
    for pattern in (b',"usage":null', b'"usage":null,'):
        if pattern in raw:
            return raw.replace(pattern, b"", 1)
    return raw


ENGINE_FIELDS = ("timings",)


def without_engine_fields(data: bytes) -> bytes:
    """The JSON payload minus engine-only fields (llama.cpp `timings`); unchanged if none or invalid."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(obj, dict) or not any(key in obj for key in ENGINE_FIELDS):
        return data
    for key in ENGINE_FIELDS:
        obj.pop(key, None)
    return orjson.dumps(obj)


class BodyInfo(NamedTuple):
    usage: dict[str, Any] | None = None
    model: str = ""
    text: str = ""
    timings: Any = None


def read_json_body(parts: list[bytes] | None, encoding: bytes = b"identity") -> BodyInfo:
    """What a non-streaming JSON response says: usage, model, generated text, engine timings."""
    if not parts:
        return BodyInfo()
    try:
        raw = b"".join(parts)
        if encoding != b"identity":
            raw = zlib.decompress(raw, 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS)
        obj = orjson.loads(raw)
    except (orjson.JSONDecodeError, zlib.error):
        return BodyInfo()
    if not isinstance(obj, dict):
        return BodyInfo()
    texts = []
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict):
            message = choice.get("message") or {}
            text = message.get("content") if isinstance(message, dict) else None
            text = text if isinstance(text, str) else choice.get("text")
            if isinstance(text, str):
                texts.append(text)
    usage, model = obj.get("usage"), obj.get("model")
    return BodyInfo(usage if isinstance(usage, dict) else None, model if isinstance(model, str) else "", "".join(texts), obj.get("timings"))
