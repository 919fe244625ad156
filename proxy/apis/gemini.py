"""Google's Gemini API (`google-genai`, REST): `POST …/models/{model}:generateContent` and
`:streamGenerateContent`, under `/v1beta/` or `/v1/` (and Vertex AI's
`/v1/projects/{p}/locations/{l}/publishers/google/models/{model}:…`).

The path names the model and whether it streams. A stream is SSE with `?alt=sse` (what the SDK
asks for) and otherwise one JSON array sent element by element (`framing.ArrayDecoder`). Each
event is a `GenerateContentResponse`: content is `candidates[].content.parts[].text` (a part
with `thought: true` is visible reasoning) and a `functionCall` part's `args` (a tool call);
`usageMetadata` is cumulative, the last one counts: prompt = `promptTokenCount` (cached input
included), cached = `cachedContentTokenCount`, completion = `candidatesTokenCount` +
`thoughtsTokenCount`, reasoning = `thoughtsTokenCount` (hidden when no thought part streamed).
An `error` object fails the request. Other operations (`:countTokens`, `:embedContent`, the model
list) are relayed untimed (`gemini_other`).

The key comes in `x-goog-api-key` or the `key` query parameter: forwarded as it came, or (with an
upstream key, or when it is the proxy's own) dropped from the query and the upstream's written to
the header; the proxy never records a path or query string, so it appears in no record.
"""
from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode


from ..wire.chunk import BodyInfo, Chunk, count, listed, string
from ..wire.text import json_text
from ..wire.tokens import REPLY_PRIMING, TOKENS_PER_MESSAGE, Parts, PromptParts
from . import Dialect, Route

_PATH = re.compile(r"^/v1(?:beta\d*|alpha)?/(?:projects/[^/]+/locations/[^/]+/publishers/google/)?(?:tuned)?models/([^/:]+):(\w+)$")
# Gemini's other model operations and its model list under its own base (/v1/models stays OpenAI's list).
_GEMINI = re.compile(r"^/v1(?:beta\d*|alpha)/(?:projects/[^/]+/locations/[^/]+/publishers/google/)?(?:tuned)?models(?:/|$)")


class Gemini(Dialect):
    name = "gemini"
    provider = "gcp.gemini"
    key_headers = (b"x-goog-api-key",)
    key_prefix = b""

    def route(self, path: str, query: bytes = b"") -> Route | None:
        match = _PATH.match(path)
        if match is None:
            return Route(self, "gemini_other", timed=False) if _GEMINI.match(path) else None
        model, method = match.groups()
        if method not in ("generateContent", "streamGenerateContent"):
            return Route(self, "gemini_other", timed=False, model=model)
        stream = method == "streamGenerateContent"
        return Route(self, "generate_content", model=model, stream=stream, framing="sse" if b"alt=sse" in query else "array")

    def upstream_query(self, query: bytes, drop_key: bool) -> bytes:
        if not drop_key or b"key=" not in query:
            return query
        return urlencode([(k, v) for k, v in parse_qsl(query.decode("latin-1"), keep_blank_values=True) if k != "key"]).encode()

    def model_and_stream(self, endpoint: str, parsed: dict[str, Any]) -> tuple[str, bool]:
        return "", False  # both from the path (Route.model, Route.stream)

    def prompt_parts(self, endpoint: str, parsed: dict[str, Any]) -> PromptParts:
        """`systemInstruction` and each content's text parts (function calls and responses as JSON);
        inline data and files are uncounted parts. An estimate: Gemini reports its own counts."""
        parts = Parts("")
        parts.fixed = REPLY_PRIMING
        system = parsed.get("systemInstruction") or parsed.get("system_instruction")
        contents = parsed.get("contents")
        items = ([system] if isinstance(system, dict) else []) + (contents if isinstance(contents, list) else
                                                                  [{"parts": [{"text": contents}]}] if isinstance(contents, str) else [])
        for content in items:
            if not isinstance(content, dict):
                continue
            parts.fixed += TOKENS_PER_MESSAGE
            parts.value(content.get("role"))  # (as OpenAI's guide counts it: the same prompt, the same count)
            for part in listed(content.get("parts")):
                if not isinstance(part, dict):
                    continue
                if isinstance(part.get("text"), str):
                    parts.texts.append(part["text"])
                elif "functionCall" in part or "functionResponse" in part:
                    parts.texts.append(json_text(part.get("functionCall") or part.get("functionResponse")))
                else:
                    parts.uncounted += 1
        return parts.done()

    def read(self, obj: dict[str, Any], chunk: Chunk) -> None:
        if isinstance(obj.get("error"), dict):
            chunk.failed = string(obj["error"].get("status")) or str(obj["error"].get("code") or "error")
            return
        for position, candidate in enumerate(listed(obj.get("candidates"))):
            if isinstance(candidate, dict):
                text, thought = _parts_text(candidate)
                if text:
                    index = candidate.get("index")
                    chunk.texts.append((index if isinstance(index, int) else position, text))
                    chunk.reasoning = chunk.reasoning or thought
        usage = obj.get("usageMetadata")
        if isinstance(usage, dict):
            chunk.usage = chat_usage(usage)
        chunk.model = string(obj.get("modelVersion"))

    def body(self, obj: dict[str, Any]) -> BodyInfo:
        texts = [_parts_text(c)[0] for c in listed(obj.get("candidates")) if isinstance(c, dict)]
        usage = obj.get("usageMetadata")
        return BodyInfo(chat_usage(usage) if isinstance(usage, dict) else None, string(obj.get("modelVersion")), "".join(texts))


def _parts_text(candidate: dict[str, Any]) -> tuple[str, bool]:
    """(generated text of a candidate's parts, whether any of it is a thought)."""
    content = candidate.get("content")
    out, thought = [], False
    for part in listed(content.get("parts")) if isinstance(content, dict) else []:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str) and part["text"]:
            out.append(part["text"])
            thought = thought or part.get("thought") is True
        elif isinstance(part.get("functionCall"), dict):
            out.append(json_text(part["functionCall"].get("args") or {}))
    return "".join(out), thought


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """`usageMetadata` in the chat shape (completion = candidates + thoughts, as OpenAI counts reasoning)."""
    out: dict[str, Any] = {}
    prompt, cached = count(usage, "promptTokenCount"), count(usage, "cachedContentTokenCount")
    candidates, thoughts = count(usage, "candidatesTokenCount"), count(usage, "thoughtsTokenCount")
    if prompt is not None:
        out["prompt_tokens"] = prompt
        out["prompt_tokens_details"] = {"cached_tokens": cached or 0}
    if candidates is not None or thoughts is not None:
        out["completion_tokens"] = (candidates or 0) + (thoughts or 0)
        if thoughts is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": thoughts}
    return out
