"""The reader of one streamed response: what its bytes meant, noted on the request's record.

The relay forwards each upstream read first, then hands a copy here: decoded when the upstream
compressed it (`compression.py`), framed into SSE events (`sse.py`), each event read by the
request's API (`apis/`) into a `Chunk`, and the chunk noted on the timing record (instants and
counts only; nothing is built until the request finishes). Framing stops for good, and the request
counts as unmeasured, when bytes fail to decode or an event outgrows `--max-event-bytes`; the
bytes still go to the client as they come.

In rewrite mode (the proxy injected usage, or strips engine fields) the reader also says what to
forward for each read: the events as they came, minus what the client did not ask for.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ..errors import RemoteProtocolError
from ..wire.chunk import Chunk, Template, learn, without_engine_fields
from ..wire.compression import DecodeError, Decoder
from ..wire.engine import from_llamacpp, from_vllm
from ..wire.framing import Framer
from ..wire.sse import EventTooLarge
from ..wire.text import ERROR_CODE_CHARS, storable

if TYPE_CHECKING:
    from ..apis import Dialect
    from ..measure.context import RequestContext

log = logging.getLogger("llmproxy.relay")

LEARNS = 8  # content events a stream's template is learned from, at most


class Reader:
    __slots__ = ("dialect", "ctx", "t", "in_flight", "decoder", "inflate", "injected", "strip", "done", "template", "learns", "stamps", "choices",
                 "texts")

    def __init__(self, dialect: Dialect, ctx: RequestContext, in_flight: Callable[[], int], decoder: Framer | None,
                 inflate: Decoder | None, injected: bool, strip: bool) -> None:
        self.dialect, self.ctx, self.t, self.in_flight = dialect, ctx, ctx.timing, in_flight
        self.decoder, self.inflate = decoder, inflate  # decoder None: not framed (or no longer)
        self.injected, self.strip = injected, strip
        self.done = False  # the API's end-of-stream (or error) event went by: a client leaving now has had everything
        self.template: Template | None = None  # the stream's content event, read without its JSON (chunk.py)
        self.learns = 0
        t = self.t  # (its lists, held here: an attribute of the record is a lookup per chunk)
        self.stamps, self.choices, self.texts = t.content_ns, t.content_choice, t.chunk_text

    def feed(self, chunk: bytes, now: int) -> None:
        """A read already forwarded: note what it meant."""
        decoder, inflate = self.decoder, self.inflate
        if decoder is None:
            return
        if inflate is None and (data := decoder.one(chunk)) is not None:  # the usual read: one whole event
            self.note(data, now)
            return
        try:
            for event in decoder.feed(chunk if inflate is None else inflate.feed(chunk)):
                self.note(event.data, now)
        except (DecodeError, EventTooLarge) as exc:
            for event in getattr(exc, "events", ()):  # (what the same read completed before it)
                self.note(event.data, now)
            self.unframed(exc)

    def rewrite(self, chunk: bytes, now: int) -> bytes:
        """Rewrite mode: the bytes to forward for one read (decoded, if the upstream compressed)."""
        decoder, inflate = self.decoder, self.inflate
        if inflate is not None:
            try:
                chunk = inflate.feed(chunk)
            except DecodeError as exc:  # the client was promised decoded bytes: nothing sensible remains to send
                self.unframed(exc)
                raise RemoteProtocolError("the upstream's compressed stream could not be decoded") from None
        if decoder is None:
            return chunk
        if (data := decoder.one(chunk)) is not None:  # the usual read: one whole event
            return self.rewritten(chunk, data, now)
        try:
            return b"".join([self.rewritten(event.raw, event.data, now) for event in decoder.feed(chunk)])
        except EventTooLarge as exc:
            self.unframed(exc)
            return b"".join([self.rewritten(event.raw, event.data, now) for event in exc.events]) + bytes(exc.pending)

    def flush(self, now: int, rewrite: bool) -> bytes:
        """The upstream ended: an unterminated last event still counts; in rewrite mode, its bytes."""
        if self.decoder is None:
            return b""
        events = self.decoder.flush()
        if rewrite:
            return b"".join([self.rewritten(event.raw, event.data, now) for event in events])
        for event in events:
            self.note(event.data, now)
        return b""

    def unframed(self, exc: Exception) -> None:
        """Framing stops (undecodable bytes, an event past the limit): the rest is relayed, unmeasured."""
        self.t.unmeasured = "event_too_large" if isinstance(exc, EventTooLarge) else "undecodable"
        self.decoder = None
        log.warning("stream no longer measured (%s): %s", self.t.unmeasured, exc)

    def note(self, data: bytes | None, now: int) -> Chunk | None:
        """Record what an event means for timing; returns the parsed chunk (None: no data)."""
        if data is None:
            return None
        template = self.template
        chunk = template.match(data) if template is not None else None
        if chunk is None:
            chunk = self.dialect.event(data)
            if chunk.texts and self.learns < LEARNS:  # (a server that changes more than the text: a few tries, then none)
                self.learns += 1
                self.template = learn(data, chunk, self.dialect.event) or template
        t = self.t
        if chunk.texts:
            stamps = self.stamps
            if not stamps:  # decode starts: how many requests share the engine now
                t.in_flight_at_decode = self.in_flight()
            for index, text in chunk.texts:
                stamps.append(now)
                self.choices.append(index)
                self.texts.append(text)
        if chunk.reasoning:
            t.reasoning_streamed = True
        if chunk.hidden:
            t.hidden_reasoning_blocks += 1
        if chunk.model and not t.response_model:
            t.response_model = chunk.model
            if chunk.ident:
                t.response_id = chunk.ident
        if chunk.usage is not None:  # merged: an API may report its counts over several events (Anthropic)
            ctx = self.ctx
            ctx.usage = {**ctx.usage, **chunk.usage} if ctx.usage else chunk.usage
        if chunk.timings is not None:
            t.engine = from_llamacpp(chunk.timings) or t.engine
        if chunk.metrics is not None:
            t.engine = from_vllm(chunk.metrics) or t.engine
        if chunk.engine is not None:
            t.engine = chunk.engine
        if not chunk.valid:
            t.malformed_chunks += 1
        if chunk.failed:  # the stream itself reported an error (`response.failed`, an `error` event)
            t.outcome, t.error = "upstream_error", f"stream_error:{storable(chunk.failed, ERROR_CODE_CHARS)}"  # (the upstream's string)
        # After the API's end event, or an error event (an SDK raises on it and closes), a client
        # leaving has had all there is: the request keeps its outcome, never client_disconnect.
        if chunk.final or chunk.failed:
            self.done = True
        return chunk

    def rewritten(self, raw: bytes, data: bytes | None, now: int) -> bytes:
        """Rewrite mode: the bytes to forward for one event, `raw` with its `data` (b"" drops it)."""
        chunk = self.note(data, now)
        if chunk is None:
            return raw
        out = self.dialect.forwarded(chunk, raw) if self.injected else raw
        if self.strip and out and (chunk.timings is not None or chunk.metrics is not None) and data is not None:
            out = out.replace(data, without_engine_fields(data), 1)
        return out
