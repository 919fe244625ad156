"""The hot path: a streamed response's bytes, from the upstream connection to the client's, as they come.

Per piece the pump does almost nothing: the piece's read instant is already taken (connection.py,
in the protocol callback); it is forwarded untouched (or, in rewrite mode, as the reader rewrites
its events), then the reader notes what it meant (timestamps and counts only); the inter-chunk
limit is moved at most once per sixteenth of itself. Two ways, one set of steps:

- `forward`, the fast way: called by the upstream connection's protocol callback, for a piece read
  while the relay's task is waiting for one and the client is taking bytes. It writes the piece to
  the client's transport at once (`BodyWriter`, made by server.py: HTTP/1.1 chunked framing, as uvicorn's ASGI
  send would), with no task switch and no ASGI send per piece;
- `run`, the task's loop: a piece that found the client not taking bytes (its write buffer over the
  high-water mark: a slow reader), or the pieces read ahead behind it (the read-ahead, connection.py),
  go through the ASGI send, which waits for the client's flow control; between pieces read ahead it
  lets the loop run, so that a backlog drained at once never holds up the reading (and stamping) of
  every stream. It also ends the response.

The order is kept: the fast way is taken only when nothing is read ahead and no send is under way.

Held (a stream another replica may still take, relay.py): until the first content token, nothing
goes to the client, not even the response's start; each piece is noted and kept, and the first
content (any body, for a response that is not a stream) releases them all at once (`release`: the
start, then the pieces kept), after which the pump runs as above. The client waits for that token
anyway, so holding costs it nothing. A held stream that reports an error before any content (vLLM's
and SGLang's `data: {"error": ...}` under a 200) is abandoned when the relay says another attempt
follows (`on_failed`): the client sees only the other replica's answer. Also released: when the relay says no other attempt can follow
any more (`unhold`, from its deadline timer), and when what is kept passes the read-ahead limits
(it counts against them, per stream and for the process, as read-ahead does: connection.py).
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..measure.timing import now_ns

if TYPE_CHECKING:
    from ..measure.timing import RequestTiming
    from .connection import Budget, Connection
    from .reader import Reader


class BodyWriter:
    """A streamed response's body pieces written straight to the client's transport, HTTP/1.1 chunked
    framing as uvicorn's ASGI send writes it, for the fast way: one write per piece, no coroutine.
    `ready` says whether a piece may go now: the client is taking bytes (uvicorn's flow control is not
    paused), the response is chunked and still open, the client still there; when it is not, the
    relay uses the ASGI send, which waits for the client. Made by the server's protocol for each
    request (server.py); here, compiled with the rest of a chunk's path, so that its two calls per
    chunk are not two interpreted frames."""

    def __init__(self, protocol: Any, cycle: Any) -> None:
        self.protocol, self.cycle, self.transport = protocol, cycle, protocol.transport

    @property
    def chunked(self) -> bool:
        """(Known once the response head went out.)"""
        cycle = self.cycle
        return bool(cycle.response_started and cycle.chunked_encoding and cycle.scope["method"] != "HEAD")

    def ready(self) -> bool:
        cycle = self.cycle
        return not (self.protocol.flow.write_paused or cycle.disconnected or cycle.response_complete or self.transport.is_closing())

    def write(self, body: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


NON_STREAM_BODY_LIMIT = 16 * 1024 * 1024  # bytes kept for reading usage from a JSON body


class Pump:
    __slots__ = ("t", "send", "reader", "rewrite", "framed", "json_body", "kept", "silence", "loop", "idle", "grace", "grace_ns",
                 "move_at_ns", "decoding", "sending", "writer", "held", "release", "on_first", "held_bytes", "budget", "waiting",
                 "unholding", "task", "response", "on_failed", "abandoned")

    def __init__(self, t: RequestTiming, send: Callable[[dict[str, Any]], Awaitable[None]], reader: Reader | None, rewrite: bool,
                 json_body: list[bytes] | None, silence: asyncio.Timeout | None, idle_s: float, writer: BodyWriter | None,
                 release: Callable[[], Awaitable[None]] | None = None, on_first: Callable[[], None] | None = None,
                 on_failed: Callable[[], bool] | None = None) -> None:
        self.t, self.send, self.reader, self.rewrite, self.json_body = t, send, reader, rewrite, json_body
        self.framed = reader is not None and reader.decoder is not None
        self.kept = 0
        # The inter-chunk limit is moved at most once per `grace` (idle/16), to `idle + grace` ahead:
        # a stream is cut after between idle and 17/16 idle of silence, and a chunk costs no timer.
        # Whether it is due is read off the piece's own read instant (one integer comparison per
        # chunk); only a move asks the loop for its clock. With no limit, it is never due.
        self.silence, self.loop, self.idle, self.grace = silence, asyncio.get_running_loop(), idle_s, idle_s / 16
        self.grace_ns = int(self.grace * 1e9)
        self.move_at_ns = 0 if silence is not None else 1 << 62
        self.decoding = bool(t.content_ns)
        self.sending = False  # handing bytes to a client that is not taking them (a timeout now is the client's: client_slow)
        self.writer = writer if writer is not None and writer.chunked else None  # None: every piece through the ASGI send
        self.release = release  # held: sends the response's start when the first content comes (None: sent already)
        self.held: list[bytes] | None = [] if release is not None else None
        self.held_bytes = 0  # of the pieces kept, counted in the read-ahead budget until they go
        self.budget: Budget | None = None
        self.waiting = False  # held, and waiting for the next piece (only there may `unhold` interrupt)
        self.unholding = False
        self.task: asyncio.Task[Any] | None = None
        self.on_first = on_first  # told when the first content token came (the replica's pending prefill work, its health)
        self.response: Connection | None = None  # (`run`'s: when the loop read the first token, its `seen_ns`)
        self.on_failed = on_failed  # held, the stream reported an error before any content: True, another attempt follows
        self.abandoned = False  # ... and it did: nothing held goes to the client

    def _moved(self, now: int) -> None:
        """Move the inter-chunk limit (called when `move_at_ns` is past, or at the first token)."""
        silence = self.silence
        if silence is None:
            return
        silence.reschedule(self.loop.time() + self.idle + self.grace)
        self.move_at_ns = now + self.grace_ns

    def _noted(self, chunk: bytes, now: int) -> None:
        """After a passthrough piece went out: what it meant (the reader), or the JSON body kept."""
        if self.framed:
            self.reader.feed(chunk, now)  # type: ignore[union-attr]
        elif self.json_body is not None and self.kept < NON_STREAM_BODY_LIMIT:
            self.json_body.append(chunk)
            self.kept += len(chunk)

    def _first_token(self, sent: int) -> None:
        """This piece held the first token: when the loop read it and when it was handed on; the inter-chunk limit starts."""
        self.decoding, self.t.first_sent_ns = True, sent
        if self.response is not None:
            self.t.first_seen_ns = self.response.seen_ns
        self._moved(sent)
        if self.on_first is not None:
            self.on_first()

    async def _hold(self, response: Connection) -> None:
        """Held: each piece noted and kept until the first content (any body, unframed), the end, `unhold` or
        the read-ahead limits; then all of it at once."""
        held, read, budget = self.held, response.read, response.budget
        assert held is not None and self.release is not None
        self.budget, self.task = budget, asyncio.current_task()
        while True:
            chunk = await self._read_held(read)
            if chunk is None:
                break  # unheld
            if not chunk:
                return  # (the end: `run` releases what there was)
            now = response.read_ns
            kept = self.reader.rewrite(chunk, now) if self.rewrite else chunk  # type: ignore[union-attr]
            held.append(kept)
            if not self.rewrite:
                self._noted(chunk, now)
            self.held_bytes += len(kept)
            budget.used += len(kept)
            t = self.t
            if t.error and not t.content_ns and self.on_failed is not None and t.error.startswith("stream_error") and self.on_failed():
                self.abandoned = True  # (an in-band error before any content, and another replica will answer)
                return
            if self.t.content_ns or not self.framed or self.held_bytes > budget.per_stream or budget.used > budget.total:
                break
        await self._release_held()

    async def _read_held(self, read: Callable[[], Awaitable[bytes]]) -> bytes | None:
        """The next piece; None: `unhold` interrupted the wait."""
        self.waiting = True
        try:
            return await read()
        except asyncio.CancelledError:
            if not self.unholding or self.task is None:
                raise
            self.task.uncancel()
            self.unholding = False
            return None
        finally:
            self.waiting = False

    def unhold(self) -> None:
        """From the relay's deadline timer, no other attempt possible: what is held goes now, the rest as it comes."""
        if self.held is not None and self.waiting and self.task is not None:
            self.unholding = True
            self.task.cancel()

    def discard(self) -> None:
        """The pieces kept leave the read-ahead budget (released, or the attempt abandoned)."""
        if self.budget is not None and self.held_bytes:
            self.budget.used -= self.held_bytes
            self.held_bytes = 0

    async def _release_held(self) -> None:
        """The response's start and every piece kept, at once."""
        assert self.held is not None and self.release is not None
        self.discard()
        await self.release()
        body, self.held = b"".join(self.held), None
        sent = now_ns()
        self.sending = True
        await self.send({"type": "http.response.body", "body": body, "more_body": True})
        self.sending = False
        if self.t.content_ns:
            self._first_token(sent)

    def forward(self, chunk: bytes, now: int) -> bool:
        """The fast way, in the upstream protocol's callback; False: not now (the task's loop takes it)."""
        writer = self.writer
        if writer is None or not writer.ready():
            return False
        decoding = self.decoding
        if decoding and now > self.move_at_ns:
            self._moved(now)
        if self.rewrite:
            out = self.reader.rewrite(chunk, now)  # type: ignore[union-attr]
            sent = 0 if decoding else now_ns()
            if out:
                writer.write(out)
        else:
            sent = 0 if decoding else now_ns()
            writer.write(chunk)
            self._noted(chunk, now)
        if not decoding and self.t.content_ns:
            self._first_token(sent)
        return True

    async def run(self, response: Connection) -> None:
        """The task's loop: the pieces the fast way did not take, then the end of the response."""
        t, send, read = self.t, self.send, response.read
        self.response = response
        if self.held is not None:
            await self._hold(response)
            if self.abandoned:
                return
        response.fast = self.forward if self.writer is not None and self.held is None else None
        try:
            while chunk := await read():
                now = response.read_ns  # when the bytes came off the socket (connection.py), not when this task woke
                decoding = self.decoding
                if decoding and now > self.move_at_ns:
                    self._moved(now)
                self.sending = True
                # `sent`: as the bytes are handed to the server (as for the last byte: a client the kernel
                # runs first once woken, on this busy machine, is not the proxy's own time)
                if self.rewrite:
                    out = self.reader.rewrite(chunk, now)  # type: ignore[union-attr]
                    sent = 0 if decoding else now_ns()
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                else:
                    sent = 0 if decoding else now_ns()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    self._noted(chunk, now)
                self.sending = False
                if not decoding and t.content_ns:
                    self._first_token(sent)
                if response.backlog:
                    # Read ahead: the next piece is there without a wait, and a client that just took a
                    # few MB at once would have the whole backlog relayed in one go (tens of ms of
                    # events read and rewritten) while no socket is read: every stream's next stamp late.
                    await asyncio.sleep(0)
        finally:
            response.fast = None
        t.upstream_end_ns = now = response.read_ns or now_ns()
        if self.held is not None:  # ended without content (an empty answer): what there was, now
            await self._release_held()
        self.sending = True  # the upstream is done: a timeout from here on is the client's
        if self.reader is not None and (out := self.reader.flush(now, self.rewrite)):
            await send({"type": "http.response.body", "body": out, "more_body": True})
        # Stamped as the last write is handed over: on a busy machine the kernel may run the woken
        # client first, and that wait is not the proxy's own time.
        t.response_end_ns = now_ns()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
