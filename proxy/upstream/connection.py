"""One HTTP/1.1 connection to the upstream: an asyncio Protocol feeding httptools' response parser.

Why not httpcore: per read it took an anyio lock and cancel scope and ran h11's pure-Python
parser, which made the proxy's upstream side cost more CPU per relayed chunk than everything else
(bench/RESULTS.md). Here a read is one call into llhttp (C) and a deque append. No timer is armed
per read: the relay's own deadline (`asyncio.timeout_at`) bounds every wait on the body.

The parser decodes chunked transfer encoding; each HTTP chunk stays its own piece, so nothing is
coalesced. Each piece carries the instant its bytes reached the socket (`read_ns`): the kernel's,
measure/arrival.py, within a tick, when the loop read them late (a CPU quota, a burst), else the
loop's own, taken here in the protocol callback, not when the relay's task next runs: on a busy
event loop that task may wake milliseconds later, and a stamp taken then would overstate TTFT by
as much. `seen_ns` is when the loop read the last bytes: from arrival to it, the proxy's own lag.

A slow client: the pieces wait here, read ahead of the client, so every one keeps the stamp of
when the upstream sent it (a stamp taken when a slow client let the relay read would be the
client's pace, not the engine's). The read-ahead is bounded per stream (`Budget.per_stream`,
--stream-buffer-bytes) and across every stream of the process (`Budget.total`,
--stream-buffer-total-bytes, exceeded by at most one socket read per stream): past either, reading
pauses and the kernel's buffers push back on the upstream, as they would without a proxy; the
response is then `held_back` (its later stamps may be the client's pace: the relay marks it).
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable

import httptools

from ..errors import ReadError, RemoteProtocolError, WriteError
from ..measure.arrival import arrived_ns, let_go, socket_of
from ..measure.timing import now_ns

class Budget:
    """Bytes read ahead of slow clients, per stream and across all of this process's streams (one
    event loop: no lock)."""

    def __init__(self, per_stream: int = 8 * 1024 * 1024, total: int = 128 * 1024 * 1024) -> None:
        self.per_stream, self.total = max(64 * 1024, per_stream), max(64 * 1024, total)
        self.used = 0


class Connection(asyncio.Protocol):
    """A keep-alive connection; one request at a time. `expires_at` is a loop.time() instant."""

    def __init__(self, loop: asyncio.AbstractEventLoop, budget: Budget | None = None) -> None:
        self.loop = loop
        self.budget = budget or Budget()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.expires_at = 0.0
        self.closed = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._now = 0  # the instant the bytes being parsed reached the socket (arrival.py)
        self.seen_ns = 0  # ... and when the loop read them
        self.sock: Any = None  # the TCP socket (uvloop's stand-in), asked when bytes arrived
        self.rtt_s: float | None = None  # the kernel's smoothed RTT of this socket, as last read (pool.py)
        self.rtt_ns = 0  # when it was read
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.length_known = False  # content-length or chunked: the end is in the bytes, not at EOF
        self.headers_ns = 0  # when the response's head was read
        self.read_ns = 0  # when the piece `read` returned last (at the end: when the end was read)
        self._end_ns = 0
        self._release_buffer()
        self._body: deque[tuple[bytes, int]] = deque()
        self._buffered = 0
        self._paused = False
        self.held_back = False  # reading paused mid-response: the stream's read-ahead (or the process's) was full
        self.held_ns = 0  # how long, in all
        self._held_at = 0
        # The relay's fast way (pump.Pump.forward): a piece read while the relay waits for one and
        # nothing is read ahead goes to it from this callback; False: it could not (buffered instead).
        self.fast: Callable[[bytes, int], bool] | None = None

    def _release_buffer(self) -> None:
        """What this response still holds goes back to the process's budget (a client that left)."""
        buffered = getattr(self, "_buffered", 0)
        if buffered:
            self.budget.used -= buffered
            self._buffered = 0
            self._body.clear()

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sock = socket_of(transport)  # (the TCP socket's: a TLS transport made later keeps it)

    def data_received(self, data: bytes) -> None:
        self.seen_ns = seen = now_ns()
        self._now = arrived_ns(self.sock, seen)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(RemoteProtocolError("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"malformed HTTP response: {exc}"))
        budget = self.budget
        if not self._paused and (self._buffered > budget.per_stream or budget.used > budget.total) and self.transport is not None:
            self._paused = self.held_back = True
            self._held_at = self._now
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.headers_done and not self.complete and not self.length_known:
            self.complete = True  # a body delimited by the connection's end (no length, not chunked)
            self._end_ns = now_ns()
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        let_go(self.sock)
        self.sock = None
        if self.headers_done and not self.complete and not self.length_known and exc is None:
            self.complete = True
            self._end_ns = now_ns()
        if not self.complete and self.error is None:
            detail = f": {exc}" if exc else ""
            where = "mid-response" if self.headers_done else "before answering"
            self.error = (ReadError if exc else RemoteProtocolError)(f"the upstream closed the connection {where}{detail}")
        self._wake()
        self.resume_writing()  # a sender waiting to drain sees `closed`

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = self.loop.create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # -- httptools callbacks ----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.length_known = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self.headers_ns = self._now
        self._wake()

    def on_body(self, body: bytes) -> None:
        fast = self.fast
        if fast is not None and self._waiter is not None and not self._body:
            try:
                if fast(body, self._now):
                    return
            except Exception as exc:  # (a bug, or a stream that cannot be decoded): raised in the relay's task, by read()
                self._fail(exc)
                return
        self._body.append((body, self._now))
        self._buffered += len(body)
        self.budget.used += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._end_ns = self._now
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- used by the pool and the relay -----------------------------------------------------
    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def write(self, head: bytes, body: bytes) -> bool:
        """Hand the request to the transport; True when the caller must `drain` (a big body)."""
        self._reset()
        transport = self.transport
        if transport is None or self.closed or transport.is_closing():
            raise WriteError("the upstream connection is closed")
        if len(body) < 16384:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        return self._drained is not None

    async def drain(self) -> None:
        while self._drained is not None:
            await asyncio.shield(self._drained)
        if self.closed and not self.headers_done:  # (an early answer, e.g. a 413, is still read)
            raise WriteError("the upstream connection closed while sending")

    async def response_head(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            if self.complete or self.closed:
                raise RemoteProtocolError("the upstream closed the connection without a response")
            await self._wait()

    def tunnelled(self) -> None:
        """The CONNECT exchange with an egress proxy is over: what comes next (TLS, then the upstream's
        responses) is parsed afresh."""
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def head_only(self) -> None:
        """A HEAD response has no body, whatever its content-length says."""
        self.complete, self.keep_alive = True, False

    async def read(self) -> bytes:
        """The next piece of the body as it came off the wire (b"" at its end); `read_ns` says when it was read."""
        while True:
            if self._body:
                data, self.read_ns = self._body.popleft()
                self._buffered -= len(data)
                self.budget.used -= len(data)
                if self._paused and self._may_resume():
                    self._paused = False
                    self.held_ns += now_ns() - self._held_at
                    self.transport.resume_reading()  # type: ignore[union-attr]
                return data
            if self.complete:
                self.read_ns = self._end_ns
                return b""
            if self.error is not None:
                raise self.error
            if self.closed:
                raise ReadError("the upstream connection closed")
            await self._wait()

    def _may_resume(self) -> bool:
        """Below a quarter of its own read-ahead, and the process below its total; an emptied stream
        resumes whatever the total (it must not starve waiting for the others)."""
        budget = self.budget
        return self.transport is not None and (self._buffered == 0 or (self._buffered < budget.per_stream // 4 and budget.used <= budget.total))

    @property
    def backlog(self) -> bool:
        """Pieces are read ahead, waiting for the relay (a slow client)."""
        return bool(self._body)

    @property
    def held_s(self) -> float:
        """Seconds reading was paused for a slow client during this response (a pause still on counts to now)."""
        return (self.held_ns + (now_ns() - self._held_at if self._paused else 0)) / 1e9

    def reusable(self, now: float) -> bool:
        """Whole response read, server keeps it open, nothing unexpected arrived, not expired."""
        return (self.complete and self.keep_alive and not self.closed and not self._body and self.error is None
                and self.transport is not None and not self.transport.is_closing() and now < self.expires_at)

    def close(self) -> None:
        self.closed = True
        self._release_buffer()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Mid-response: drop the connection now (an engine such as vLLM aborts the generation), and
        what it read ahead for the client with it."""
        self.closed = True
        self._release_buffer()
        if self.transport is not None:
            self.transport.abort()
