"""One upstream response on its way to the client: the relay's response side, one per attempt.

From the response's head it decides what the bytes are (an SSE stream, another framing the route
reads, a JSON body, anything else), whether the proxy rewrites them (usage it injected, engine
fields it strips), and whether its start is held: on a route whose attempt may still be abandoned
for another replica (relay.py), nothing reaches the client before the first content token, then
everything kept goes at once (pump.py). Then the pump relays the body as it comes; a non-streaming
body the proxy must rewrite is read whole first. An abandoned attempt's Reply is simply dropped.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..measure.timing import now_ns
from ..upstream.pump import BodyWriter, Pump
from ..upstream.reader import Reader
from ..wire.chunk import without_engine_fields
from ..wire.compression import DecodeError, Decoder
from ..wire.engine import from_tgi
from ..wire.framing import framer
from .request import filter_headers, header

if TYPE_CHECKING:
    from .. import apis
    from ..config import Settings
    from ..measure.context import RequestContext
    from ..measure.timing import RequestTiming
    from ..upstream.connection import Connection
    from ..upstream.pool import Pool

log = logging.getLogger("llmproxy.relay")
Start = Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None]]
ERROR_BODY_LIMIT = 64 * 1024  # an upstream 400 read whole, to see whether it rejects stream_options


class Reply:
    __slots__ = ("ctx", "t", "route", "settings", "in_flight", "send", "start", "writer", "on_first", "idle_s", "injected", "strip",
                 "rewrite", "json_body", "body_encoding", "reader", "pump", "held_start", "on_failed")

    def __init__(self, ctx: RequestContext, route: apis.Route, settings: Settings, in_flight: Callable[[], int],
                 send: Callable[[dict[str, Any]], Awaitable[None]], start: Start, writer: BodyWriter | None,
                 on_first: Callable[[], None] | None, idle_s: float, injected: bool, on_failed: Callable[[], bool] | None = None) -> None:
        self.ctx, self.t, self.route, self.settings, self.in_flight = ctx, ctx.timing, route, settings, in_flight
        self.send, self.start, self.writer, self.on_first, self.idle_s = send, start, writer, on_first, idle_s
        self.injected = injected  # we asked for include_usage: drop the usage chunk, strip usage:null
        self.strip = False  # --strip-engine-fields applies to this response
        self.rewrite = False  # forward per SSE event instead of per read
        self.json_body: list[bytes] | None = None  # a JSON answer's bytes, kept to read its usage after
        self.body_encoding = b"identity"
        self.reader: Reader | None = None  # what the response's bytes meant
        self.pump: Pump | None = None  # the hot path of its body (pump.py)
        self.held_start: tuple[int, list[tuple[bytes, bytes]]] | None = None  # a held response's start, sent at its first content
        self.on_failed = on_failed  # a held stream's error before its first content: True, another attempt follows (relay.py)

    async def respond(self, response: Connection, silence: asyncio.Timeout, hold: bool) -> None:
        """The head read: the client's start (or held, `hold`: a stream another replica may still take), then the body."""
        t, settings = self.t, self.settings
        t.status_code = response.status
        if response.status >= 400:
            t.outcome = "upstream_error"
        t.engine = from_tgi(response.headers) or t.engine
        out_headers = filter_headers(response.headers)
        content_type = header(response.headers, b"content-type", b"")
        encoding = header(response.headers, b"content-encoding", b"identity").strip().lower()
        compressed = encoding not in (b"identity", b"")
        is_sse = content_type.startswith(b"text/event-stream")
        # A stream: SSE, or what the route frames otherwise (Ollama's NDJSON, Gemini's JSON array).
        framing = "sse" if is_sse else (self.route.framing if t.stream and self.route.framing != "sse" and response.status < 400 else "")
        # Untimed routes (a stored response's stream, GET /v1/responses/{id}?stream=true) are relayed, never read.
        timed = bool(framing) and self.route.timed
        json_ok = self.route.timed and not framing and response.status < 400 and (b"json" in content_type or not content_type)
        self.strip = settings.strip_engine_fields and (is_sse or (json_ok and not compressed))
        self.rewrite = is_sse and (self.injected or self.strip)
        if json_ok:
            self.json_body, self.body_encoding = [], encoding
        inflate = None
        if timed and compressed:
            try:
                inflate = Decoder(encoding, settings.max_event_bytes)
            except DecodeError:
                t.unmeasured, timed, self.rewrite = "undecodable", False, False
        if self.rewrite and inflate is not None:  # asked for identity and got it compressed: the client gets it decoded
            out_headers = [(k, v) for k, v in out_headers if k.lower() != b"content-encoding"]
        self.reader = Reader(self.route.dialect, self.ctx, self.in_flight, framer(framing, settings.max_event_bytes) if timed else None,
                             inflate, self.injected, self.strip)
        if framing:
            out_headers.append((b"x-accel-buffering", b"no"))
        elif self.strip:
            await self._buffered(response, out_headers)
            return
        length = header(response.headers, b"content-length", None)
        if length is not None and not self.rewrite:
            out_headers.append((b"content-length", length))
        if hold and response.status < 400 and t.stream:
            self.held_start = (response.status, out_headers)  # held until the first content (pump.py): it may go elsewhere yet
        else:
            await self.start(response.status, out_headers)
        self.pump = Pump(t, self.send, self.reader, self.rewrite, self.json_body, silence, self.idle_s, self.writer,
                         self._release if self.held_start is not None else None, self.on_first, self.on_failed)
        await self.pump.run(response)

    async def _release(self) -> None:
        assert self.held_start is not None
        await self.start(*self.held_start)

    async def _buffered(self, response: Connection, out_headers: list[tuple[bytes, bytes]]) -> None:
        """Non-streaming with --strip-engine-fields: the body is rewritten whole, then sent."""
        t = self.t
        parts = []
        while part := await response.read():
            parts.append(part)
        t.upstream_end_ns = now_ns()
        self.json_body = parts
        body = without_engine_fields(b"".join(parts))
        await self.start(response.status, content_length(out_headers, body))
        t.response_end_ns = now_ns()
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def content_length(headers: list[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(len(body)).encode())]


async def options_rejected(response: Connection, start: Start, send: Callable[[dict[str, Any]], Awaitable[None]], t: RequestTiming) -> bool:
    """An upstream's 400 to a request the proxy added stream_options to: True, it rejects them (the relay sends the
    client's own request again); else the 400 goes to the client as it came."""
    raw = b""
    while part := await response.read():
        raw += part
        if len(raw) > ERROR_BODY_LIMIT:
            break
    if b"stream_options" in raw and len(raw) <= ERROR_BODY_LIMIT:
        return True
    await start(response.status, content_length(filter_headers(response.headers), raw))
    await send({"type": "http.response.body", "body": raw, "more_body": len(raw) > ERROR_BODY_LIMIT})
    if len(raw) > ERROR_BODY_LIMIT:  # (the rest as it comes, never read)
        while part := await response.read():
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    t.status_code, t.outcome = response.status, "upstream_error"
    t.upstream_end_ns = t.response_end_ns = now_ns()
    return False


async def without_options(pool: Pool, method: str, response: Connection, url: bytes, headers: list[tuple[bytes, bytes]], original: bytes,
                          t: RequestTiming) -> Connection:
    """The client's own request again, to an upstream that rejects stream_options (older Azure api-versions); it is
    not asked for them again."""
    log.warning("the upstream %s rejects stream_options: requests go unchanged from now on", pool.label)
    pool.rejects_stream_options = True
    pool.release(response)
    t.reset_upstream()
    headers = [(k, str(len(original)).encode() if k == b"content-length" else v) for k, v in headers]
    return await pool.send(method, url, headers, original, t)
