"""OpenAI's API: chat completions, completions, embeddings and the Responses API, under `/v1`.

Chat and completions: a content chunk carries generated text for a choice (`choices[].index`):
`delta.content`, `delta.refusal`, visible reasoning (`delta.reasoning_content` /
`delta.reasoning`: some vLLM builds send both with the same text, so one of them is taken, never
both), tool-call `function.arguments`, the legacy `delta.function_call.arguments`, or
`choices[].text` (completions). Role-only, finish-only and usage-only chunks (`choices: []` plus
`usage`) are not content. `data: [DONE]` ends the stream. Usage comes on the last chunk, and only
when asked for: the proxy asks (`stream_options.include_usage`) when a streaming client did not,
and strips what it asked for again (the usage-only chunk, `"usage": null` on the others).

The Responses API streams typed events (`"type"` in each payload): content is the `delta` of an
output text, refusal, reasoning text or summary, function-call arguments or custom-tool input
event; usage comes in `response.completed` (`input_tokens`, `output_tokens` and their details),
read into the chat shape; `response.failed` and `error` fail it. Its stored-response operations
(`/v1/responses/{id}…`) are relayed untimed (`responses_other`).

vLLM's per-request `metrics` and llama.cpp's `timings` ride on the last chunk or on the body.
"""
from __future__ import annotations

import re
from typing import Any

import orjson

from ..wire.chunk import DONE, BodyInfo, Chunk, count, json_object, listed, string, strip_usage_null
from ..wire.text import json_text
from ..wire.tokens import REPLY_PRIMING, TOKENS_PER_MESSAGE, TOKENS_PER_NAME, Parts, PromptParts
from . import Dialect, Route

ENDPOINTS = {"/chat/completions": "chat", "/completions": "completions", "/embeddings": "embeddings", "/responses": "responses"}
RESPONSES_RESOURCE = "/responses/"  # stored-response operations: GET/DELETE /responses/{id}, /input_items, /cancel


class OpenAI(Dialect):
    name = "openai"
    injects_usage = True
    prefix = "/v1"

    def route(self, path: str, query: bytes = b"") -> Route | None:
        if not path.startswith(self.prefix + "/"):
            return None
        return self.operation(path[len(self.prefix):])

    def operation(self, rest: str, model: str = "") -> Route | None:
        """The route for a path below the API's base (`/chat/completions`, `/responses/{id}`)."""
        endpoint = ENDPOINTS.get(rest)
        if endpoint is not None:
            return Route(self, endpoint, model=model)
        if rest.startswith(RESPONSES_RESOURCE):
            return Route(self, "responses_other", timed=False)
        return None

    def prompt_parts(self, endpoint: str, parsed: dict[str, Any]) -> PromptParts:
        return prompt_parts(endpoint, parsed)

    def event(self, data: bytes) -> Chunk:
        return parse_chunk(data)

    def body(self, obj: dict[str, Any]) -> BodyInfo:
        return read_body(obj)

    def inject(self, endpoint: str, parsed: dict[str, Any], raw: bytes) -> bytes | None:
        if endpoint not in ("chat", "completions") or (parsed.get("_partial") and "stream_options" in parsed):
            return None
        return usage_injected_body(parsed, raw)

    def forwarded(self, chunk: Chunk, raw: bytes) -> bytes:
        return b"" if chunk.usage_only else strip_usage_null(raw)


def _delta_text(delta: dict[str, Any]) -> tuple[str, bool]:
    """(generated text, whether any of it is visible reasoning)."""
    if len(delta) == 1:  # the usual delta: its content alone (nothing else to look for)
        content = delta.get("content")
        if isinstance(content, str):
            return content, False
    reasoning = string(delta.get("reasoning_content")) or string(delta.get("reasoning"))
    parts = [string(delta.get("content")), string(delta.get("refusal")), reasoning]
    call = delta.get("function_call")
    if isinstance(call, dict):
        parts.append(string(call.get("arguments")))
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        for item in calls:
            fn = item.get("function") if isinstance(item, dict) else None
            if isinstance(fn, dict):
                parts.append(string(fn.get("arguments")))
    return "".join(parts), bool(reasoning)


def parse_chunk(data: bytes) -> Chunk:
    chunk = Chunk()
    if data == DONE:
        chunk.final = True
        return chunk
    obj = json_object(data)
    if obj is None:
        chunk.valid = False
        return chunk
    # Exact types, not isinstance: orjson makes only these, and an exact check costs less per event.
    get = obj.get
    choices = get("choices")
    if choices is None and "choices" not in obj:
        kind = get("type")
        if kind.__class__ is str:
            _response_event(kind, obj, chunk)
            return chunk
        error = get("error")  # a failure after the stream began, under its 200 (vLLM, SGLang: `{"error": {...}}`;
        if error.__class__ is dict or get("object") == "error":  # older vLLM: `{"object": "error", ...}`)
            detail = error if error.__class__ is dict else obj
            chunk.failed = string(detail.get("type")) or str(detail.get("code") or "") or "error"
            return chunk
    elif choices.__class__ is list:
        for position, choice in enumerate(choices):
            if choice.__class__ is not dict:
                continue
            delta = choice.get("delta")
            if delta.__class__ is dict:
                text = delta.get("content") if len(delta) == 1 else None  # the usual delta: its content alone
                if text.__class__ is not str:
                    text, reasoning = _delta_text(delta)
                    if reasoning:
                        chunk.reasoning = True
            else:
                text = string(choice.get("text"))
            if text:
                index = choice.get("index")
                chunk.texts.append((index if index.__class__ is int else position, text))
    usage = get("usage")
    if usage.__class__ is dict:
        chunk.usage = usage
        chunk.usage_only = choices == []
    model = get("model")
    if model.__class__ is str:
        chunk.model = model
    timings = get("timings")
    if timings.__class__ is dict:
        chunk.timings = timings
    metrics = get("metrics")
    if metrics.__class__ is dict:
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
        text = string(obj.get("delta"))
        if text:
            chunk.texts.append((0, text))
            chunk.reasoning = reasoning
        return
    if kind == "error":
        chunk.failed = string(obj.get("code")) or "error"
        return
    response = obj.get("response")
    if not isinstance(response, dict):
        return
    chunk.model, chunk.ident = string(response.get("model")), string(response.get("id"))
    usage = response.get("usage")
    if isinstance(usage, dict):
        chunk.usage = chat_usage(usage)
    metrics = response.get("metrics")  # vLLM's per-request metrics ride on response.completed
    if isinstance(metrics, dict):
        chunk.metrics = metrics
    if kind == "response.failed":
        error = response.get("error")
        chunk.failed = (string(error.get("code")) if isinstance(error, dict) else "") or "response_failed"
    chunk.final = kind in ("response.completed", "response.failed", "response.incomplete")


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses API usage object in the chat shape (input → prompt, output → completion)."""
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return usage  # already chat-shaped (some servers)
    out: dict[str, Any] = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
                           "total_tokens": usage.get("total_tokens")}
    cached = count(usage.get("input_tokens_details"), "cached_tokens")
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    reasoning = count(usage.get("output_tokens_details"), "reasoning_tokens")
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def _response_text(obj: dict[str, Any]) -> str:
    """The generated text of a Responses API body: output text, refusals, reasoning, call arguments."""
    parts: list[str] = []
    for item in listed(obj.get("output")):
        if not isinstance(item, dict):
            continue
        parts.append(string(item.get("arguments")))
        for key in ("content", "summary"):
            for part in listed(item.get(key)):
                if isinstance(part, dict):
                    parts.append(string(part.get("text")) or string(part.get("refusal")))
    return "".join(parts)


def read_body(obj: dict[str, Any]) -> BodyInfo:
    """A chat, completions, embeddings or Responses API body: usage, model, generated text, engine timings."""
    model, metrics = string(obj.get("model")), obj.get("metrics")
    metrics = metrics if isinstance(metrics, dict) else None
    if obj.get("object") == "response":
        usage = obj.get("usage")
        return BodyInfo(chat_usage(usage) if isinstance(usage, dict) else None, model, _response_text(obj), None, metrics,
                        ident=string(obj.get("id")))
    texts = []
    for choice in listed(obj.get("choices")):
        if isinstance(choice, dict):
            message = choice.get("message")
            texts.append(_delta_text(message)[0] if isinstance(message, dict) else string(choice.get("text")))
    usage = obj.get("usage")
    return BodyInfo(usage if isinstance(usage, dict) else None, model, "".join(texts), obj.get("timings"), metrics)


def prompt_parts(endpoint: str, body: dict[str, Any]) -> PromptParts:
    """Chat: OpenAI's token-counting guide (3 per message, 1 per name, 3 to prime the reply); text
    content parts counted, image/audio/file parts not (their count depends on pixels or seconds the
    proxy does not decode) and reported as uncounted; assistant `tool_calls` and the legacy
    `function_call` count their name and arguments; `tools` / `functions` count their JSON text, an
    approximation (OpenAI injects them in an unpublished format)."""
    parts = Parts(string(body.get("model")))
    if endpoint == "responses":
        return _responses_parts(parts, body)
    if endpoint != "chat":
        parts.input(body.get("prompt") if endpoint == "completions" else body.get("input"))
        return parts.done()
    parts.fixed = REPLY_PRIMING
    for message in listed(body.get("messages")):
        if not isinstance(message, dict):
            continue
        parts.fixed += TOKENS_PER_MESSAGE
        for key, value in message.items():
            parts.value(value)
            if key == "name":
                parts.fixed += TOKENS_PER_NAME
    for key in ("tools", "functions"):
        if isinstance(body.get(key), list) and body[key]:
            parts.texts.append(json_text(body[key]))
    return parts.done()


def _responses_parts(parts: Parts, body: dict[str, Any]) -> PromptParts:
    """Responses API: `instructions`, then `input` (a string, which is one user message, or items:
    messages whose content is a string or input_text parts, function calls and their outputs),
    counted as chat messages are."""
    parts.fixed = REPLY_PRIMING
    if isinstance(body.get("instructions"), str):
        parts.fixed += TOKENS_PER_MESSAGE
        parts.texts.append(body["instructions"])
    items = body.get("input")
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else (items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        parts.fixed += TOKENS_PER_MESSAGE
        for key in ("role", "content", "output", "arguments", "name"):
            parts.value(item.get(key))
    if isinstance(body.get("tools"), list) and body["tools"]:
        parts.texts.append(json_text(body["tools"]))
    return parts.done()


USAGE_OPTION = b'"stream_options":{"include_usage":true}'
_SPACE = re.compile(rb"[ \t\r\n]*")  # JSON's whitespace
_LONG_NUMBER = re.compile(rb"\d{16,}")  # digits a double cannot hold: re-serialising would change them


def usage_injected_body(parsed: dict[str, Any], raw: bytes) -> bytes | None:
    """The body with stream_options.include_usage set, or None when it is set or must not be.

    Without stream_options (the usual case) the option is spliced in after the opening brace and
    every other byte stays as the client wrote it. An existing stream_options object means
    re-serialising, done only when no number would lose digits in the round trip. A client that
    asked for `continuous_usage_stats` without `include_usage` gets none: switching include_usage
    on would put usage on every chunk it receives.
    """
    options = parsed.get("stream_options")
    if options is None:
        body = raw.lstrip()
        if body[:1] != b"{" or "stream_options" in parsed:
            return None
        first = _SPACE.match(body, 1).end()  # type: ignore[union-attr]  # (always matches; the body is not copied to find it)
        # (one copy of the body, not three: an agent's is 200 KB; an empty object takes no comma)
        return b"".join((b"{", USAGE_OPTION, b"" if body[first:first + 1] == b"}" else b",", memoryview(body)[1:]))
    if not isinstance(options, dict) or options.get("include_usage") or options.get("continuous_usage_stats") or _LONG_NUMBER.search(raw):
        return None
    try:
        return orjson.dumps({**parsed, "stream_options": {**options, "include_usage": True}})
    except TypeError:
        return None
