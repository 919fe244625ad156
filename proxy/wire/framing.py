"""Framing the streams that are not SSE, incrementally, linear and bounded like `sse.py`.

- NDJSON (Ollama's `/api/chat`, `/api/generate`): one JSON object per line.
- A JSON array streamed element by element (Gemini's `:streamGenerateContent` without
  `alt=sse`): `[{…},\\r\\n{…}]`; each top-level element is an event as soon as its closing brace
  arrives, never the whole array at the end.

Each returns `sse.Event`s (`raw`: the element's bytes as they came, `data`: the JSON text), so the
reader and the dialects treat every stream alike. Every byte is appended once and scanned once
(the array framer jumps between structural characters with a regex, so it never loops per byte in
Python); an unfinished element larger than `limit` raises `sse.EventTooLarge`.
"""
from __future__ import annotations

import re
from typing import Protocol

from .sse import DEFAULT_LIMIT, Event, EventTooLarge, SSEDecoder


class Framer(Protocol):
    def one(self, chunk: bytes) -> bytes | None: ...  # a read that is one whole event: its data (None: use feed)

    def feed(self, chunk: bytes) -> list[Event]: ...

    def flush(self) -> list[Event]: ...


class LineDecoder:
    """NDJSON: an event per non-blank line (LF or CRLF)."""

    __slots__ = ("_pending", "limit")

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._pending = bytearray()
        self.limit = limit

    def one(self, chunk: bytes) -> bytes | None:
        return None  # (every read is framed by feed)

    def feed(self, chunk: bytes) -> list[Event]:
        pending = self._pending
        start = len(pending)
        pending += chunk
        events: list[Event] = []
        begin, at = 0, pending.find(b"\n", start)
        while at != -1:
            line = bytes(pending[begin:at + 1])
            if line.strip():
                events.append(Event(raw=line, data=line.strip()))
            begin = at + 1
            at = pending.find(b"\n", begin)
        del pending[:begin]
        if len(pending) > self.limit:
            self._pending = bytearray()
            raise EventTooLarge(events, pending, self.limit)
        return events

    def flush(self) -> list[Event]:
        rest, self._pending = bytes(self._pending), bytearray()
        return [Event(raw=rest, data=rest.strip())] if rest.strip() else []


_STRUCTURE = re.compile(rb'[{}\[\]"]')  # outside strings, only these change the nesting
_STRING_END = re.compile(rb'["\\]')  # inside a string: its end, or an escape


class ArrayDecoder:
    """The elements of one top-level JSON array, each an event once complete."""

    __slots__ = ("_pending", "_pos", "_depth", "_in_string", "_start", "_opened", "limit")

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._pending = bytearray()
        self._pos = 0  # where scanning resumes in _pending
        self._depth = 0  # nesting inside the top-level array (1: between its elements)
        self._in_string = False
        self._start = -1  # where the current element began (-1: between elements)
        self._opened = False  # the top-level `[` went by
        self.limit = limit

    def one(self, chunk: bytes) -> bytes | None:
        return None  # (every read is framed by feed)

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._pending
        buf += chunk
        events: list[Event] = []
        pos, depth, in_string, start = self._pos, self._depth, self._in_string, self._start
        length = len(buf)
        while pos < length:
            if in_string:
                match = _STRING_END.search(buf, pos)
                if match is None:
                    pos = length
                    break
                if match.group() == b"\\":
                    if match.end() >= length:  # the escaped character is in the next read
                        pos = match.start()
                        break
                    pos = match.end() + 1
                    continue
                in_string, pos = False, match.end()
                continue
            match = _STRUCTURE.search(buf, pos)
            if match is None:
                pos = length
                break
            char, pos = match.group(), match.end()
            if char == b'"':
                in_string = True
                if depth == 1 and start < 0:
                    start = match.start()  # (an element that is a bare string)
            elif char in b"{[":
                if not self._opened:
                    self._opened, depth = True, 1
                    continue
                if depth == 1:
                    start = match.start()
                depth += 1
            else:
                depth -= 1
                if depth == 1 and start >= 0:
                    element = bytes(buf[start:pos])
                    events.append(Event(raw=element, data=element))
                    start = -1
                elif depth == 0:  # the array closed
                    self._opened = False
        keep = start if start >= 0 else pos
        del buf[:keep]
        self._pos, self._depth, self._in_string = pos - keep, depth, in_string
        self._start = 0 if start >= 0 else -1
        if start >= 0 and len(buf) > self.limit:
            self.__init__(self.limit)  # type: ignore[misc]
            raise EventTooLarge(events, buf, self.limit)
        return events

    def flush(self) -> list[Event]:
        """End of stream: an element cut off mid-way is not an event (its bytes were relayed)."""
        self.__init__(self.limit)  # type: ignore[misc]
        return []


def framer(kind: str, limit: int) -> Framer:
    """The framer for a route's stream kind: `sse`, `ndjson` or `array`."""
    if kind == "ndjson":
        return LineDecoder(limit)
    if kind == "array":
        return ArrayDecoder(limit)
    return SSEDecoder(limit)
