"""Anthropic's Messages API: `POST /v1/messages` (Claude Code, the `anthropic` SDK, llama.cpp's
and vLLM's own `/v1/messages`), key in `x-api-key`.

A stream is typed SSE events. Content is a `content_block_delta` of any kind that carries
generated text: `text_delta`, `thinking_delta` (visible reasoning, so decode) and
`input_json_delta` (a tool call's arguments); `signature_delta` and `citations_delta` carry no
generated text, and `ping`, `content_block_start` / `_stop` and `message_*` events are structure.
A `redacted_thinking` block arrives whole in its `content_block_start`: reasoning that was
generated and never streamed (hidden). Usage is always reported, so nothing is injected:
`message_start.message.usage` has the input (prompt = `input_tokens` + `cache_read_input_tokens`
+ `cache_creation_input_tokens`; cached = the cache reads, so prefill runs over the rest) and each
`message_delta.usage` the cumulative `output_tokens` (the last one counts), with
`output_tokens_details.thinking_tokens` (reasoning) when the API reports it. `message_stop` ends
the stream; an `error` event (`overloaded_error`, …) fails it. `/v1/messages/count_tokens` and the
batch operations are relayed untimed (`messages_other`).
"""
from __future__ import annotations

from typing import Any


from ..wire.chunk import BodyInfo, Chunk, count, listed, string
from ..wire.text import json_text
from ..wire.tokens import REPLY_PRIMING, TOKENS_PER_MESSAGE, Parts, PromptParts
from . import Dialect, Route

DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}  # delta type: its text field


class Anthropic(Dialect):
    name = "anthropic"
    provider = "anthropic"
    key_headers = (b"x-api-key", b"authorization")  # OAuth tokens (auth_token) come as Authorization: Bearer
    key_prefix = b""

    def route(self, path: str, query: bytes = b"") -> Route | None:
        if path == "/v1/messages":
            return Route(self, "messages")
        if path.startswith("/v1/messages/"):
            return Route(self, "messages_other", timed=False)
        return None

    def prompt_parts(self, endpoint: str, parsed: dict[str, Any]) -> PromptParts:
        """`system`, each message's text, tool-use input and tool results, and `tools` as JSON;
        images and documents are uncounted parts. An estimate with the proxy's BPE (Anthropic's
        tokenizer is not public); the usage Anthropic reports is what counts."""
        parts = Parts(string(parsed.get("model")))
        parts.fixed = REPLY_PRIMING
        _blocks(parts, parsed.get("system"))
        for message in listed(parsed.get("messages")):
            if isinstance(message, dict):
                parts.fixed += TOKENS_PER_MESSAGE
                parts.value(message.get("role"))  # (counted as OpenAI's guide counts it: the same prompt, the same count)
                _blocks(parts, message.get("content"))
        if isinstance(parsed.get("tools"), list) and parsed["tools"]:
            parts.texts.append(json_text(parsed["tools"]))
        return parts.done()

    def read(self, obj: dict[str, Any], chunk: Chunk) -> None:
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                field = DELTA_TEXT.get(delta.get("type"))  # type: ignore[arg-type]
                text = string(delta.get(field)) if field else ""
                if text:
                    chunk.texts.append((0, text))
                    chunk.reasoning = field == "thinking"
        elif kind == "content_block_start":
            block = obj.get("content_block")
            chunk.hidden = isinstance(block, dict) and block.get("type") == "redacted_thinking"
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                chunk.model = string(message.get("model"))
                usage = message.get("usage")
                if isinstance(usage, dict):
                    chunk.usage = chat_usage(usage, output=False)
        elif kind == "message_delta":
            usage = obj.get("usage")
            if isinstance(usage, dict):
                chunk.usage = chat_usage(usage)
        elif kind == "message_stop":
            chunk.final = True
        elif kind == "error":
            error = obj.get("error")
            chunk.failed = (string(error.get("type")) if isinstance(error, dict) else "") or "error"

    def body(self, obj: dict[str, Any]) -> BodyInfo:
        texts = []
        for block in listed(obj.get("content")):
            if isinstance(block, dict):
                kind = block.get("type")
                if kind == "text":
                    texts.append(string(block.get("text")))
                elif kind == "thinking":
                    texts.append(string(block.get("thinking")))
                elif kind in ("tool_use", "server_tool_use") and block.get("input") is not None:
                    texts.append(json_text(block.get("input")))
        usage = obj.get("usage")
        return BodyInfo(chat_usage(usage) if isinstance(usage, dict) else None, string(obj.get("model")), "".join(texts))


def chat_usage(usage: dict[str, Any], output: bool = True) -> dict[str, Any]:
    """Anthropic usage in the chat shape, with only the counts it carries (a stream's events are
    merged in order: the input counts from `message_start`, the cumulative output from each
    `message_delta`, which may repeat the input counts)."""
    out: dict[str, Any] = {}
    uncached, read, created = (count(usage, key) for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    if uncached is not None:
        out["prompt_tokens"] = uncached + (read or 0) + (created or 0)
        out["prompt_tokens_details"] = {"cached_tokens": read or 0}
    completion = count(usage, "output_tokens")
    if output and completion is not None:
        out["completion_tokens"] = completion
        thinking = count(usage.get("output_tokens_details"), "thinking_tokens")
        if thinking is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": thinking}
    return out


def _blocks(parts: Parts, content: Any) -> None:
    """A string, or content blocks: text, tool_use input, tool_result content, thinking; images,
    documents and the rest are parts the tokenizer cannot count."""
    if isinstance(content, str):
        parts.texts.append(content)
        return
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            parts.value(block.get("text"))
        elif kind == "tool_use":
            parts.value(block.get("name"))
            parts.texts.append(json_text(block.get("input")))
        elif kind == "tool_result":
            _blocks(parts, block.get("content"))
        elif kind == "thinking":
            parts.value(block.get("thinking"))
        else:
            parts.uncounted += 1
