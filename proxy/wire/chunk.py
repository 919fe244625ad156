"""What one streamed event or JSON body means for timing, in one shape for every API.

Each dialect (`proxy/apis/`) reads its own wire format into a `Chunk` (per event) or a `BodyInfo`
(per non-streaming body); usage is always read into OpenAI's chat shape (`prompt_tokens`,
`completion_tokens`, `prompt_tokens_details.cached_tokens`,
`completion_tokens_details.reasoning_tokens`), so every count downstream is defined once.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, NamedTuple

import orjson

from .engine import COUNT_MAX, EngineTimings

DONE = b"[DONE]"


class Chunk:
    """One event's meaning. Class-level defaults: an event sets only what it says (one per chunk read:
    a dozen attribute writes per event cost more than the rest of reading a content delta)."""

    reasoning: bool = False  # visible reasoning text was streamed in this chunk
    usage: dict[str, Any] | None = None
    model: str = ""
    usage_only: bool = False
    valid: bool = True
    timings: dict[str, Any] | None = None  # llama.cpp's per-request timings
    metrics: dict[str, Any] | None = None  # vLLM's per-request metrics (--enable-per-request-metrics)
    failed: str = ""  # the stream reported an error (Responses API `response.failed` / `error`): its code
    final: bool = False  # the API's end-of-stream event (`[DONE]`, `message_stop`): the client has everything
    hidden: bool = False  # a block of hidden reasoning began (Anthropic `redacted_thinking`): never streamed
    engine: EngineTimings | None = None  # the engine's own timings, read by the dialect (Ollama's last object)
    ident: str = ""  # the answer's id where a later request may name it (a Responses API response: previous_response_id)

    def __init__(self) -> None:
        self.texts: list[tuple[int, str]] = []  # (choice index, generated text), choices with content only

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.texts)


def json_object(data: bytes) -> dict[str, Any] | None:
    """The JSON object a body or an event's data holds, or None (not JSON, or not an object: a malformed chunk).
    Read as leniently as the engines read it: where orjson refuses, Python's own parser, which FastAPI's and so vLLM's
    and SGLang's servers read a request with, is asked (`lenient`)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = lenient(data)
    return obj if isinstance(obj, dict) else None


def lenient(data: bytes) -> Any:
    """What Python's json makes of what orjson refused: a lone surrogate escape (`"\\ud800"`), NaN and Infinity, an
    integer past 64 bits, UTF-16 or a byte-order mark; None where it refuses too (its result's strings may hold lone
    surrogates and its numbers be NaN or huge: every sink makes them storable, `text.py`, and counts are range-checked,
    `count`)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None


def string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def listed(value: Any) -> list[Any]:
    """A JSON array's items; none for anything else a broken or hostile peer sent in its place (`true`, an object)."""
    return value if isinstance(value, list) else []


class Usage(NamedTuple):
    """Counts from an OpenAI usage object; None where absent."""

    prompt: int | None = None
    completion: int | None = None
    cached_prompt: int | None = None  # prompt_tokens_details.cached_tokens
    reasoning: int | None = None  # completion_tokens_details.reasoning_tokens (part of completion)


def count(obj: Any, key: str) -> int | None:
    """A token count an upstream reported: a non-negative integer a store can hold, else None."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= COUNT_MAX else None


def read_usage(usage: dict[str, Any] | None) -> Usage:
    if not usage:
        return Usage()
    return Usage(count(usage, "prompt_tokens"), count(usage, "completion_tokens"),
                 count(usage.get("prompt_tokens_details"), "cached_tokens"),
                 count(usage.get("completion_tokens_details"), "reasoning_tokens"))


_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')
_SPACE = b" \t\r\n"


def strip_usage_null(raw: bytes) -> bytes:
    """Remove the `"usage": null` key that include_usage adds to every chunk (any spacing).

    Linear in the event's size: a key is located with `find` and matched anchored there (an
    unanchored pattern starting with whitespace backtracks quadratically over padded text).
    A `"usage"` followed by `:` cannot sit inside a JSON string, whose quotes are escaped.
    """
    for compact in (b',"usage":null', b'"usage":null,'):  # compact (every server we know): one search, no replace
        at = raw.find(compact)
        if at != -1:
            return raw[:at] + raw[at + len(compact):]
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


_UNSAFE = re.compile(rb'["\\\x00-\x1f]')  # what ends a JSON string, escapes in it, or is not allowed in it


class Template:
    """One stream's content event around its text: the bytes before the text's opening quote and
    from its closing quote on, learned from an event the dialect read (`learn`).

    A server repeats the same event, id and model and all, with only the text changed. An event
    that is the prefix, then text with no quote, backslash or control character, then the suffix,
    is the learned event with another string there: its JSON is the same but for that value, so
    the dialect would read the same chunk with this text. Such an event is read here without
    parsing its JSON (a fifth of a relayed chunk's Python). Anything else is `None`: the
    dialect reads it."""

    def __init__(self, prefix: bytes, suffix: bytes, index: int, reasoning: bool, model: str) -> None:
        self.prefix, self.suffix, self.index, self.reasoning, self.model = prefix, suffix, index, reasoning, model
        self.size = len(prefix) + len(suffix)

    def match(self, data: bytes) -> Chunk | None:
        if len(data) <= self.size or not data.startswith(self.prefix) or not data.endswith(self.suffix):
            return None
        middle = data[len(self.prefix):len(data) - len(self.suffix)]
        if _UNSAFE.search(middle) is not None:
            return None
        try:
            text = middle.decode()
        except UnicodeDecodeError:
            return None  # (the dialect finds it malformed)
        chunk = Chunk()
        chunk.texts.append((self.index, text))
        if self.reasoning:
            chunk.reasoning = True
        if self.model:
            chunk.model = self.model
        return chunk


def _rest(chunk: Chunk) -> tuple[Any, ...]:
    """What a chunk says besides its texts."""
    return (chunk.reasoning, chunk.usage, chunk.model, chunk.usage_only, chunk.valid, chunk.timings, chunk.metrics,
            chunk.failed, chunk.final, chunk.hidden, chunk.engine)


def learn(data: bytes, chunk: Chunk, event: Callable[[bytes], Chunk]) -> Template | None:
    """The template of a content event the dialect read as `chunk` (one text, no usage, no end), or None.

    The text, JSON-encoded, must occur once in the event's bytes; the proof that it is the text is
    the dialect's own reading of the event with another text there (`event`, once per template)."""
    if len(chunk.texts) != 1 or chunk.usage is not None or chunk.timings is not None or chunk.metrics is not None \
            or chunk.engine is not None or chunk.failed or chunk.final or chunk.hidden or chunk.usage_only or not chunk.valid:
        return None
    index, text = chunk.texts[0]
    encoded = orjson.dumps(text)
    at = data.find(encoded)
    if at == -1 or data.find(encoded, at + 1) != -1:
        return None  # (the server escapes it otherwise, or the same string is elsewhere too)
    prefix, suffix = data[:at + 1], data[at + len(encoded) - 1:]
    marker = "\u00b5" if text != "\u00b5" else "\u00df"
    probe = event(prefix + marker.encode() + suffix)
    if probe.texts != [(index, marker)] or _rest(probe) != _rest(chunk):
        return None
    return Template(prefix, suffix, index, chunk.reasoning, chunk.model)


class BodyInfo(NamedTuple):
    usage: dict[str, Any] | None = None  # chat-shaped
    model: str = ""
    text: str = ""  # the generated text (counted by the tokenizer when usage is missing)
    timings: Any = None
    metrics: Any = None
    undecodable: bool = False  # the body's content-encoding could not be decoded
    engine: EngineTimings | None = None  # the engine's own timings, read by the dialect (Ollama)
    ident: str = ""  # a stored answer's id (a Responses API response), for the requests that name it
