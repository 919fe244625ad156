"""The relay: one request in, one upstream exchange, bytes out as they arrive. The hot path.

The loop in `_stream` timestamps each upstream read, forwards it untouched, then frames a copy to
note content chunks. It builds no metric, span or log: `Telemetry.finish` does that once, from the
timing record, after the last byte went out. Only when the proxy injected
`stream_options.include_usage` does it forward per SSE event, to drop the usage-only chunk the
client did not ask for.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

import httpcore

from .chunk import DONE, Chunk, parse_chunk, read_json_body, strip_usage_null, without_engine_fields
from .engine import from_llamacpp
from .errors import BadPath, BodyTimeout, BodyTooLarge, ProxyError, Unauthorized, UpstreamTimeout, map_transport_error
from .request import filter_headers, parse_request, usage_injected_body
from .sse import Event, SSEDecoder
from .timing import RequestTiming, now_ns

log = logging.getLogger("llmproxy.relay")

NON_STREAM_BODY_LIMIT = 16 * 1024 * 1024  # bytes kept for reading usage from a JSON body


class ClientGone(Exception):
    """Raised into the relay when the client disconnected."""


class Exchange:
    """One proxied request. Created per request; `run` is the whole ASGI response."""

    def __init__(self, app: Any, scope: dict[str, Any], receive: Any, send: Any, timing: RequestTiming) -> None:
        self.app, self.scope, self.receive, self.send, self.t = app, scope, receive, send, timing
        self.relaying = False
        self.client_gone = False
        self.response: httpcore.Response | None = None
        self.usage: dict[str, Any] | None = None
        self.json_body: list[bytes] | None = None
        self.body_encoding = b"identity"
        self.injected = False  # we asked for include_usage: drop the usage chunk, strip usage:null
        self.strip = False  # --strip-engine-fields applies to this response
        self.rewrite = False  # forward per SSE event instead of per read

    async def _read_body(self) -> bytes:
        """The whole request body, bounded in size (413) and in time (408)."""
        settings = self.app.settings
        limit = settings.max_body_bytes
        declared = _header(self.scope["headers"], b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
        parts, size = [], 0
        try:
            async with asyncio.timeout(settings.body_timeout):
                while True:
                    message = await self.receive()
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

    def _check_request(self) -> None:
        """Proxy authentication and path sanity, before the body is read."""
        keys = self.app.client_keys
        if keys:
            auth = _header(self.scope["headers"], b"authorization", b"")
            token = auth[7:].strip().decode("latin-1") if auth[:7].lower() == b"bearer " else ""
            if not any(hmac.compare_digest(token, key) for key in keys):
                raise Unauthorized("missing or incorrect API key for the proxy")
        segments = self.scope["path"].split("/")
        if ".." in segments or "." in segments:
            raise BadPath("paths with dot segments are not relayed")

    async def _watch(self, task: asyncio.Task[Any]) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                if self.relaying:
                    self.client_gone = True
                    task.cancel()
                return

    async def run(self) -> None:
        t, app = self.t, self.app
        wall_offset = time.time_ns() - t.received_ns
        try:
            self._check_request()
            body = await self._read_body()
        except ClientGone:
            t.outcome, t.status_code = "client_disconnect", 499
            await app.telemetry.finish(t, None, wall_offset)
            return
        except ProxyError as error:  # refused before anything went upstream
            await self._fail(error)
            await app.telemetry.finish(t, None, wall_offset)
            return
        t.endpoint, parsed = parse_request(self.scope["path"][3:], body)
        if parsed is not None:
            t.model = str(parsed.get("model") or "unknown")
            t.stream = parsed.get("stream") is True
            if t.stream and app.settings.inject_usage and not app.upstream.reports_counts and t.endpoint in ("chat", "completions"):
                new_body = usage_injected_body(parsed, body)
                if new_body is not None:
                    body, self.injected = new_body, True
        headers = app.upstream_headers(self.scope["headers"], len(body))
        spans = app.telemetry.start(t, self.scope["headers"], parsed, wall_offset, len(body))
        if spans is not None:
            headers.append((b"traceparent", spans.traceparent()))
        task = asyncio.current_task()
        assert task is not None
        self.relaying = True
        watcher = asyncio.create_task(self._watch(task))
        try:
            await self._exchange(body, headers)
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            task.uncancel()
            t.outcome = "client_disconnect"
            t.status_code = t.status_code or 499
        finally:
            self.relaying = False
            watcher.cancel()
            if self.response is not None:
                await app.upstream.release(self.response)  # mid-body: closes the socket, so vLLM aborts
            if t.response_end_ns is None:
                t.response_end_ns = now_ns()
            t.upstream_end_ns = t.upstream_end_ns or t.response_end_ns
        body_info = read_json_body(self.json_body, self.body_encoding)
        if body_info.timings is not None and t.engine is None:
            t.engine = from_llamacpp(body_info.timings)
        if t.stream and t.engine is not None and t.engine.predicted_tokens is not None:
            app.upstream.reports_counts = True
        await app.telemetry.finish(t, spans, wall_offset, self.usage, body_info)

    async def _exchange(self, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        t, app = self.t, self.app
        url = app.upstream.url(self.scope["path"][3:], self.scope.get("query_string", b""))
        try:
            async with asyncio.timeout(app.settings.first_token_timeout):
                self.response = await app.upstream.send(self.scope["method"], url, headers, body, t)
        except TimeoutError:
            await self._fail(UpstreamTimeout(f"no response from the upstream within {app.settings.first_token_timeout} s ({app.upstream.label})"))
            return
        except Exception as exc:
            await self._fail(map_transport_error(exc, app.upstream.label))
            return
        response = self.response
        t.status_code = response.status
        if response.status >= 400:
            t.outcome = "upstream_error"
        out_headers = filter_headers(response.headers)
        content_type = _header(response.headers, b"content-type", b"")
        encoding = _header(response.headers, b"content-encoding", b"identity")
        is_sse = content_type.startswith(b"text/event-stream")
        json_ok = not is_sse and response.status < 400 and encoding in (b"identity", b"gzip", b"deflate")
        self.strip = app.settings.strip_engine_fields and (is_sse or (json_ok and encoding == b"identity"))
        self.rewrite = is_sse and (self.injected or self.strip)
        if is_sse:
            out_headers.append((b"x-accel-buffering", b"no"))
        elif self.strip:
            await self._buffered(response, out_headers)
            return
        length = _header(response.headers, b"content-length", None)
        if length is not None and not self.rewrite:
            out_headers.append((b"content-length", length))
        if json_ok:
            self.json_body, self.body_encoding = [], encoding
        await self.send({"type": "http.response.start", "status": response.status, "headers": out_headers})
        try:
            await self._stream(response, SSEDecoder() if is_sse else None)
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError, TimeoutError) as exc:
            error = UpstreamTimeout("the upstream went silent mid-stream") if isinstance(exc, TimeoutError) else map_transport_error(exc, app.upstream.label)
            t.upstream_end_ns = now_ns()
            t.outcome, t.error = error.outcome, f"mid_stream:{error.code}"
            log.warning("upstream stream ended early: %s", error)
            # Leave the response incomplete: the client sees the stream break, as it would directly.
            return

    async def _stream(self, response: httpcore.Response, decoder: SSEDecoder | None) -> None:
        """The hot loop: timestamp, forward, then note what the bytes meant."""
        t, send, rewrite, json_body = self.t, self.send, self.rewrite, self.json_body
        settings, loop = self.app.settings, asyncio.get_running_loop()
        idle, kept = settings.read_timeout, 0
        waited = (now_ns() - (t.issued_ns or t.received_ns)) / 1e9
        async with asyncio.timeout(loop.time() + settings.first_token_timeout - waited) as silence:
            async for chunk in response.aiter_stream():  # type: ignore[attr-defined]
                now = now_ns()
                if t.content_ns:  # after the first token the (shorter) inter-chunk limit applies
                    silence.reschedule(loop.time() + idle)
                if rewrite:
                    out = b"".join([self._rewritten(event, now) for event in decoder.feed(chunk)])  # type: ignore[union-attr]
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                    continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if decoder is not None:
                    for event in decoder.feed(chunk):
                        self._note(event.data, now)
                elif json_body is not None and kept < NON_STREAM_BODY_LIMIT:
                    json_body.append(chunk)
                    kept += len(chunk)
        t.upstream_end_ns = now = now_ns()
        if decoder is not None:
            for event in decoder.flush():
                if not rewrite:
                    self._note(event.data, now)
                elif out := self._rewritten(event, now):
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        # Stamped as the last write is handed over: on a busy machine the kernel may run the woken
        # client first, and that wait is not the proxy's own time.
        t.response_end_ns = now_ns()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _note(self, data: bytes | None, now: int) -> Chunk | None:
        """Record what an event means for timing; returns the parsed chunk (None: no JSON data)."""
        if data is None or data == DONE:
            return None
        chunk = parse_chunk(data)
        t = self.t
        if chunk.text:
            t.content_ns.append(now)
            t.chunk_text.append(chunk.text)
        if chunk.model and not t.response_model:
            t.response_model = chunk.model
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.timings is not None:
            t.engine = from_llamacpp(chunk.timings)
        if not chunk.valid:
            t.malformed_chunks += 1
        return chunk

    def _rewritten(self, event: Event, now: int) -> bytes:
        """Rewrite mode: the bytes to forward for one event (b"" drops it)."""
        chunk = self._note(event.data, now)
        if chunk is None:
            return event.raw
        if self.injected:
            if chunk.usage_only:
                return b""  # the usage chunk the client did not ask for
            raw = strip_usage_null(event.raw)
        else:
            raw = event.raw
        if self.strip and chunk.timings is not None and event.data is not None:
            raw = raw.replace(event.data, without_engine_fields(event.data), 1)
        return raw

    async def _buffered(self, response: httpcore.Response, out_headers: list[tuple[bytes, bytes]]) -> None:
        """Non-streaming with --strip-engine-fields: the body is rewritten whole, then sent."""
        t = self.t
        parts = [part async for part in response.aiter_stream()]  # type: ignore[attr-defined]
        t.upstream_end_ns = now_ns()
        self.json_body = parts
        body = without_engine_fields(b"".join(parts))
        out_headers.append((b"content-length", str(len(body)).encode()))
        await self.send({"type": "http.response.start", "status": response.status, "headers": out_headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
        t.response_end_ns = now_ns()

    async def _fail(self, error: ProxyError) -> None:
        t = self.t
        t.outcome, t.status_code, t.error = error.outcome, error.status, error.code
        log.warning("%s", error)
        body = error.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await self.send({"type": "http.response.start", "status": error.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
        t.response_end_ns = now_ns()


def _header(headers: list[tuple[bytes, bytes]], name: bytes, default: Any) -> Any:
    return next((v for k, v in headers if k.lower() == name), default)
