"""Byte-level Server-Sent Events framing, incremental across reads.

The relay forwards raw bytes first and frames a copy, so framing never alters what the client gets.
Lines end in CRLF, LF or CR (the SSE spec); an event ends at a blank line; `:` lines are comments;
several `data:` lines join with LF. A CR at the very end of a read is held back, since the next read
may start with its LF.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(slots=True)
class Event:
    raw: bytes  # the exact bytes of the event, blank line included
    data: bytes | None  # joined data fields, None for an event with no data (comments only)


class SSEDecoder:
    """Feed it reads; it returns the events completed by each read."""

    __slots__ = ("_buffer", "_scan", "_data")

    def __init__(self) -> None:
        self._buffer = b""  # bytes of the unfinished event, from its first byte
        self._scan = 0  # offset in _buffer where the lines not yet parsed begin
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[Event] = []
        pos = self._scan
        event_start = 0
        length = len(buffer)
        while True:
            match = _LINE_END.search(buffer, pos)
            if match is None:
                break
            end = match.end()
            if end == length and match.group() == b"\r":
                break  # maybe half of CRLF: wait for the next read
            line = buffer[pos : match.start()]
            pos = end
            if line:
                self._field(line)
                continue
            data = b"\n".join(self._data) if self._data else None
            events.append(Event(raw=buffer[event_start:pos], data=data))
            self._data = []
            event_start = pos
        self._buffer = buffer[event_start:]
        self._scan = pos - event_start
        return events

    def _field(self, line: bytes) -> None:
        if line[:1] == b":":
            return
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value[1:] if value[:1] == b" " else value)

    def flush(self) -> list[Event]:
        """End of stream: an unterminated last event still counts (servers sometimes omit it)."""
        rest, tail = self._buffer, self._buffer[self._scan :]
        self._buffer, self._scan = b"", 0
        line = tail.rstrip(b"\r\n")
        if line:
            self._field(line)
        data = b"\n".join(self._data) if self._data else None
        self._data = []
        return [Event(raw=rest, data=data)] if rest else []
