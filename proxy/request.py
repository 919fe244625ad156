"""What the proxy reads from a client's request, and the one change it may make to it.

Intake first: proxy authentication, path sanity, and the body read whole within its size and
time limits.

A body it cannot parse is forwarded unchanged: only measurement degrades. The one rewrite is
`stream_options.include_usage`, asked for when a streaming client did not (exact token counts).
"""
from __future__ import annotations

import asyncio
import hmac
import re
from typing import Any

import orjson
from starlette.types import Receive, Scope

from .config import Settings
from .errors import BadPath, BodyTimeout, BodyTooLarge, Unauthorized

ENDPOINTS = {"/chat/completions": "chat", "/completions": "completions", "/embeddings": "embeddings", "/responses": "responses"}
# What is relayed but never timed as a generation: the Responses API's stored-response operations
# (GET /responses/{id}, its stream resumption too, DELETE, /input_items, /cancel).
RESPONSES_RESOURCE = "/responses/"
HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-authenticate proxy-authorization te trailer trailers transfer-encoding upgrade host content-length".split()
)


class ClientGone(Exception):
    """The client disconnected (while sending its body, or later, seen by the relay's watcher)."""


def header(headers: list[tuple[bytes, bytes]], name: bytes, default: Any) -> Any:
    return next((v for k, v in headers if k.lower() == name), default)


def check_request(scope: Scope, keys: tuple[str, ...]) -> None:
    """Proxy authentication and path sanity, before the body is read."""
    if keys:
        auth = header(scope["headers"], b"authorization", b"")
        token = auth[7:].strip().decode("latin-1") if auth[:7].lower() == b"bearer " else ""
        if not any(hmac.compare_digest(token, key) for key in keys):
            raise Unauthorized("missing or incorrect API key for the proxy")
    segments = scope["path"].split("/")
    if ".." in segments or "." in segments:
        raise BadPath("paths with dot segments are not relayed")


async def read_body(scope: Scope, receive: Receive, settings: Settings) -> bytes:
    """The whole request body, bounded in size (413) and in time (408)."""
    limit = settings.max_body_bytes
    declared = header(scope["headers"], b"content-length", b"0")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    parts, size = [], 0
    try:
        async with asyncio.timeout(settings.body_timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                part = message.get("body", b"")
                size += len(part)
                if size > limit:
                    raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
                parts.append(part)
                if not message.get("more_body"):
                    return b"".join(parts)
    except TimeoutError:
        raise BodyTimeout(f"the request body took longer than {settings.body_timeout} s to arrive") from None


def filter_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    named = {v.strip().lower() for k, v in headers if k.lower() == b"connection" for v in v.split(b",")}
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


def parse_request(path: str, body: bytes) -> tuple[str, dict[str, Any] | None]:
    """(endpoint, parsed JSON body or None). A body we cannot parse is still forwarded as is."""
    endpoint = ENDPOINTS.get(path) or ("responses_other" if path.startswith(RESPONSES_RESOURCE) else "other")
    if endpoint in ("other", "responses_other") or not body:
        return endpoint, None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return endpoint, None
    return endpoint, parsed if isinstance(parsed, dict) else None


USAGE_OPTION = b'"stream_options":{"include_usage":true}'
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
        rest = body[1:].lstrip()
        return b"{" + USAGE_OPTION + (b"" if rest[:1] == b"}" else b",") + body[1:]
    if not isinstance(options, dict) or options.get("include_usage") or options.get("continuous_usage_stats") or _LONG_NUMBER.search(raw):
        return None
    try:
        return orjson.dumps({**parsed, "stream_options": {**options, "include_usage": True}})
    except TypeError:
        return None
