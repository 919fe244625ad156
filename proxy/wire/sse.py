"""Byte-level Server-Sent Events framing, incremental across reads, linear and bounded.

The relay forwards raw bytes first and frames a copy, so framing never alters what the client gets.
Lines end in CRLF, LF or CR (the SSE spec); an event ends at a blank line; `:` lines are comments;
several `data:` lines join with LF. A CR at the very end of a read is held back, since the next read
may start with its LF.

Cost: every byte is appended once (a bytearray, amortised) and searched for a line end once, so
framing an event is linear in its size however many reads it spans. An unfinished event larger
than `limit` bytes raises `EventTooLarge` (carrying the bytes held so far): the caller stops
framing that stream and relays the rest as it comes, so one endless event can neither grow the
proxy's memory past the limit nor hold the event loop.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")
DEFAULT_LIMIT = 16 * 1024 * 1024  # --max-event-bytes: far above real events (base64 images in image streams are a few MB)


@dataclass(slots=True)
class Event:
    raw: bytes  # the exact bytes of the event, blank line included
    data: bytes | None  # joined data fields, None for an event with no data (comments only)


class EventTooLarge(Exception):
    """An event grew past the framing limit. `events`: those the same read completed before it;
    `pending`: the big event's bytes so far, not framed (the caller relays them and the rest)."""

    def __init__(self, events: list[Event], pending: bytes | bytearray, limit: int) -> None:
        super().__init__(f"an SSE event exceeded {limit} bytes")
        self.events, self.pending = events, pending


def _whole(chunk: bytes) -> list[Event]:
    """Complete events separated by single blank lines, LF line ends only, none held over: the same
    events `SSEDecoder.feed`'s general loop finds, without a regular expression per line."""
    events = []
    for block in chunk[:-2].split(b"\n\n"):
        raw = block + b"\n\n"
        if block[:6] == b"data: " and block.find(b"\n") == -1:  # one data line: most events of every API
            events.append(Event(raw, block[6:]))
            continue
        data = []
        for line in block.split(b"\n"):
            if line[:1] == b":":
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if value[:1] == b" " else value)
        events.append(Event(raw, b"\n".join(data) if data else None))
    return events


class SSEDecoder:
    """Feed it reads; it returns the events completed by each read."""

    __slots__ = ("_pending", "_scan", "_searched", "_data", "limit")

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._pending = bytearray()  # bytes of the unfinished event, from its first byte
        self._scan = 0  # offset in _pending where the lines not yet parsed begin
        self._searched = 0  # offset in _pending before which no line end remains to be found
        self._data: list[bytes] = []
        self.limit = limit

    def one(self, chunk: bytes) -> bytes | None:
        """The usual read of every API: exactly one whole event of one data line, nothing pending.
        Its data, or None (then `feed` frames it): the same event `feed` would find, without
        building it."""
        if (not self._pending and chunk.startswith(b"data: ") and chunk.find(b"\n") == len(chunk) - 2 and chunk.endswith(b"\n")
                and chunk.find(b"\r") == -1):
            # (`find`, not `in`: CPython's bytes `in` first tries its operand as an integer, and
            # builds and clears a TypeError each time: half the cost of this test per event.)
            return chunk[6:-2]
        return None

    def feed(self, chunk: bytes) -> list[Event]:
        pending = self._pending
        if not pending:
            if (data := self.one(chunk)) is not None:
                return [Event(chunk, data)]
            if chunk[-2:] == b"\n\n" and chunk.find(b"\r") == -1 and chunk.find(b"\n\n\n") == -1 and chunk[:1] != b"\n":
                return _whole(chunk)  # whole LF-terminated events, nothing held
        if pending:
            pending += chunk
            buffer: bytes | bytearray = pending
        else:
            buffer = chunk  # the usual case: nothing held, no copy
        events: list[Event] = []
        pos = self._scan
        search = max(pos, self._searched)
        event_start = 0
        length = len(buffer)
        while True:
            match = _LINE_END.search(buffer, search)
            if match is None:
                search = length
                break
            end = match.end()
            if end == length and match.group() == b"\r":
                search = match.start()  # maybe half of CRLF: look at it again with the next read
                break
            line = buffer[pos : match.start()]
            pos = search = end
            if line:
                self._field(line)
                continue
            data = b"\n".join(self._data) if self._data else None
            events.append(Event(raw=bytes(buffer[event_start:pos]), data=data))
            self._data = []
            event_start = pos
        if buffer is pending:
            del pending[:event_start]
        elif event_start < length:
            pending += buffer[event_start:]
        self._scan, self._searched = pos - event_start, search - event_start
        if len(pending) > self.limit:
            self._reset()
            raise EventTooLarge(events, pending, self.limit)  # (not copied: the decoder holds a new buffer now)
        return events

    def _field(self, line: bytes | bytearray) -> None:
        if line[:1] == b":":
            return
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(bytes(value[1:] if value[:1] == b" " else value))

    def _reset(self) -> None:
        self._pending = bytearray()
        self._scan = self._searched = 0
        self._data = []

    def flush(self) -> list[Event]:
        """End of stream: an unterminated last event still counts (servers sometimes omit it)."""
        rest, tail = bytes(self._pending), bytes(self._pending[self._scan :])
        data_lines = self._data
        self._reset()
        self._data = data_lines
        line = tail.rstrip(b"\r\n")
        if line:
            self._field(line)
        data = b"\n".join(self._data) if self._data else None
        self._data = []
        return [Event(raw=rest, data=data)] if rest else []
