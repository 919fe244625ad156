"""A client's request at intake: proxy authentication, path sanity, and the body read whole
within its size and time limits. What the body means is its API's (`proxy/apis/`)."""
from __future__ import annotations

import asyncio
import hmac
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import Receive, Scope

from ..config import Settings
from ..errors import BadPath, BodyTimeout, BodyTooLarge, Unauthorized

# Where clients put an API key, whichever API they speak: the proxy's own key (--api-key) is accepted
# in any of them, and none of them is ever logged, stored or exported.
KEY_HEADERS = (b"authorization", b"api-key", b"x-api-key", b"x-goog-api-key")
HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-authenticate proxy-authorization te trailer trailers transfer-encoding upgrade host content-length".split()
)


class ClientGone(Exception):
    """The client disconnected (while sending its body; later, the server's protocol tells the relay: server.py)."""


def header(headers: list[tuple[bytes, bytes]], name: bytes, default: Any) -> Any:
    return next((v for k, v in headers if k.lower() == name), default)


def check_request(scope: Scope, keys: tuple[str, ...]) -> None:
    """Proxy authentication and path sanity, before the body is read."""
    if keys:
        token = client_key(scope["headers"]) or query_key(scope.get("query_string", b""))
        if not any(hmac.compare_digest(token, key) for key in keys):
            raise Unauthorized("missing or incorrect API key for the proxy")
    segments = scope["path"].split("/")
    if ".." in segments or "." in segments:
        raise BadPath("paths with dot segments are not relayed")


def client_key(headers: list[tuple[bytes, bytes]]) -> str:
    """The key a client presented: `Authorization: Bearer`, or an API's own key header (Azure
    `api-key`, Anthropic `x-api-key`, Gemini `x-goog-api-key`)."""
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            if value[:7].lower() == b"bearer ":
                return value[7:].strip().decode("latin-1")
        elif name in KEY_HEADERS:
            return value.strip().decode("latin-1")
    return ""


def query_key(query: bytes) -> str:
    """A key given as the `key` query parameter (Gemini's REST convention)."""
    if b"key=" not in query:
        return ""
    return next((v for k, v in parse_qsl(query.decode("latin-1")) if k == "key"), "")


async def read_body(scope: Scope, receive: Receive, settings: Settings, complete: bool = False) -> bytes:
    """The whole request body, bounded in size (413) and in time (408). `complete`: the server's protocol
    read its last byte before this ran (server.py's stamps), so `receive` cannot wait, and no timer is set."""
    limit = settings.max_body_bytes
    declared = header(scope["headers"], b"content-length", b"0")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    if complete:
        return await _received(receive, limit)
    try:
        async with asyncio.timeout(settings.body_timeout):
            return await _received(receive, limit)
    except TimeoutError:
        raise BodyTimeout(f"the request body took longer than {settings.body_timeout} s to arrive") from None


async def _received(receive: Receive, limit: int) -> bytes:
    parts, size = [], 0
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


def filter_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    named = {v.strip().lower() for k, v in headers if k.lower() == b"connection" for v in v.split(b",")}
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]
