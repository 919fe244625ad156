"""What one SSE data payload or JSON body means for timing: content per choice, usage, or neither.

A content chunk carries generated text for a choice (`choices[].index`): `delta.content`,
`delta.refusal`, visible reasoning (`delta.reasoning_content` / `delta.reasoning`: some vLLM builds
send both with the same text, so one of them is taken, never both), tool-call
`function.arguments`, the legacy `delta.function_call.arguments`, or `choices[].text`
(completions). Role-only, finish-only and usage-only chunks (`choices: []` plus `usage`) are not
content.

The Responses API streams typed events instead (`"type"` in each payload): content is the `delta`
of an output text, refusal, reasoning text or summary, or function-call arguments event; usage
comes in `response.completed` (`input_tokens`, `output_tokens` and their details), read here into
the chat shape so every count downstream is defined once; `response.failed` and `error` fail it.
"""
from __future__ import annotations

import re
import zlib
from typing import Any, NamedTuple

import orjson

DONE = b"[DONE]"


class Chunk:
    __slots__ = ("texts", "reasoning", "usage", "model", "usage_only", "valid", "timings", "metrics", "failed")

    def __init__(self) -> None:
        self.texts: list[tuple[int, str]] = []  # (choice index, generated text), choices with content only
        self.reasoning: bool = False  # visible reasoning text was streamed in this chunk
        self.usage: dict[str, Any] | None = None
        self.model: str = ""
        self.usage_only: bool = False
        self.valid: bool = True
        self.timings: dict[str, Any] | None = None  # llama.cpp's per-request timings
        self.metrics: dict[str, Any] | None = None  # vLLM's per-request metrics (--enable-per-request-metrics)
        self.failed: str = ""  # the stream reported an error (Responses API `response.failed` / `error`): its code

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.texts)


def _string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _delta_text(delta: dict[str, Any]) -> tuple[str, bool]:
    """(generated text, whether any of it is visible reasoning)."""
    reasoning = _string(delta.get("reasoning_content")) or _string(delta.get("reasoning"))
    parts = [_string(delta.get("content")), _string(delta.get("refusal")), reasoning]
    call = delta.get("function_call")
    if isinstance(call, dict):
        parts.append(_string(call.get("arguments")))
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        for item in calls:
            fn = item.get("function") if isinstance(item, dict) else None
            if isinstance(fn, dict):
                parts.append(_string(fn.get("arguments")))
    return "".join(parts), bool(reasoning)


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
    kind = obj.get("type")
    if isinstance(kind, str) and "choices" not in obj:
        _response_event(kind, obj, chunk)
        return chunk
    choices = obj.get("choices")
    if isinstance(choices, list):
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text, reasoning = _delta_text(delta)
                chunk.reasoning = chunk.reasoning or reasoning
            else:
                text = _string(choice.get("text"))
            if text:
                index = choice.get("index")
                chunk.texts.append((index if isinstance(index, int) else position, text))
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
    metrics = obj.get("metrics")
    if isinstance(metrics, dict):
        chunk.metrics = metrics
    return chunk


# Responses API events whose `delta` is generated text, and whether it is visible reasoning.
RESPONSE_DELTAS = {
    "response.output_text.delta": False,
    "response.refusal.delta": False,
    "response.function_call_arguments.delta": False,
    "response.custom_tool_call_input.delta": False,
    "response.reasoning_text.delta": True,
    "response.reasoning_summary_text.delta": True,
}


def _response_event(kind: str, obj: dict[str, Any], chunk: Chunk) -> None:
    reasoning = RESPONSE_DELTAS.get(kind)
    if reasoning is not None:
        text = _string(obj.get("delta"))
        if text:
            chunk.texts.append((0, text))
            chunk.reasoning = reasoning
        return
    if kind == "error":
        chunk.failed = _string(obj.get("code")) or "error"
        return
    response = obj.get("response")
    if not isinstance(response, dict):
        return
    chunk.model = _string(response.get("model"))
    usage = response.get("usage")
    if isinstance(usage, dict):
        chunk.usage = chat_usage(usage)
    metrics = response.get("metrics")  # vLLM's per-request metrics ride on response.completed
    if isinstance(metrics, dict):
        chunk.metrics = metrics
    if kind == "response.failed":
        error = response.get("error")
        chunk.failed = (_string(error.get("code")) if isinstance(error, dict) else "") or "response_failed"


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses API usage object in the chat shape (input → prompt, output → completion)."""
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return usage  # already chat-shaped (some servers)
    out: dict[str, Any] = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
                           "total_tokens": usage.get("total_tokens")}
    cached = _count(usage.get("input_tokens_details"), "cached_tokens")
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    reasoning = _count(usage.get("output_tokens_details"), "reasoning_tokens")
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def _response_text(obj: dict[str, Any]) -> str:
    """The generated text of a Responses API body: output text, refusals, reasoning, call arguments."""
    parts: list[str] = []
    for item in obj.get("output") or []:
        if not isinstance(item, dict):
            continue
        parts.append(_string(item.get("arguments")))
        for key in ("content", "summary"):
            for part in item.get(key) or []:
                if isinstance(part, dict):
                    parts.append(_string(part.get("text")) or _string(part.get("refusal")))
    return "".join(parts)


class Usage(NamedTuple):
    """Counts from an OpenAI usage object; None where absent."""

    prompt: int | None = None
    completion: int | None = None
    cached_prompt: int | None = None  # prompt_tokens_details.cached_tokens
    reasoning: int | None = None  # completion_tokens_details.reasoning_tokens (part of completion)


def _count(obj: Any, key: str) -> int | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_usage(usage: dict[str, Any] | None) -> Usage:
    if not usage:
        return Usage()
    return Usage(_count(usage, "prompt_tokens"), _count(usage, "completion_tokens"),
                 _count(usage.get("prompt_tokens_details"), "cached_tokens"),
                 _count(usage.get("completion_tokens_details"), "reasoning_tokens"))


_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')
_SPACE = b" \t\r\n"


def strip_usage_null(raw: bytes) -> bytes:
    """Remove the `"usage": null` key that include_usage adds to every chunk (any spacing).

    Linear in the event's size: a key is located with `find` and matched anchored there (an
    unanchored pattern starting with whitespace backtracks quadratically over padded text).
    A `"usage"` followed by `:` cannot sit inside a JSON string, whose quotes are escaped.
    """
    for compact in (b',"usage":null', b'"usage":null,'):
        if compact in raw:
            return raw.replace(compact, b"", 1)
    at = raw.find(b'"usage"')
    while at != -1:
        match = _USAGE_NULL.match(raw, at)
        if match is not None:
            before = at
            while before > 0 and raw[before - 1] in _SPACE:
                before -= 1
            if raw[before - 1:before] == b",":
                return raw[:before - 1] + raw[match.end():]
            after = match.end()
            while after < len(raw) and raw[after] in _SPACE:
                after += 1
            if raw[after:after + 1] == b",":
                after += 1
                while after < len(raw) and raw[after] in _SPACE:
                    after += 1
                return raw[:at] + raw[after:]
            return raw  # the object's only key: left as it is
        at = raw.find(b'"usage"', at + 1)
    return raw


ENGINE_FIELDS = ("timings", "metrics")


def without_engine_fields(data: bytes) -> bytes:
    """The JSON payload minus engine-only fields (llama.cpp `timings`, vLLM `metrics`); unchanged if none or invalid."""
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
    metrics: Any = None


def read_json_body(raw: bytes, encoding: bytes = b"identity") -> BodyInfo:
    """What a non-streaming JSON response says: usage, model, generated text, engine timings.

    Pure and picklable in and out, so a large body can be read in another process.
    """
    if not raw:
        return BodyInfo()
    try:
        if encoding != b"identity":
            raw = zlib.decompress(raw, 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS)
        obj = orjson.loads(raw)
    except (orjson.JSONDecodeError, zlib.error):
        return BodyInfo()
    if not isinstance(obj, dict):
        return BodyInfo()
    if obj.get("object") == "response":
        usage, model, metrics = obj.get("usage"), obj.get("model"), obj.get("metrics")
        return BodyInfo(chat_usage(usage) if isinstance(usage, dict) else None, model if isinstance(model, str) else "",
                        _response_text(obj), None, metrics if isinstance(metrics, dict) else None)
    texts = []
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict):
            message = choice.get("message")
            if isinstance(message, dict):
                text, _ = _delta_text(message)
            else:
                text = _string(choice.get("text"))
            texts.append(text)
    usage, model = obj.get("usage"), obj.get("model")
    metrics = obj.get("metrics")
    return BodyInfo(usage if isinstance(usage, dict) else None, model if isinstance(model, str) else "", "".join(texts),
                    obj.get("timings"), metrics if isinstance(metrics, dict) else None)
