"""A minimal HTTP/1.1 streaming client on asyncio streams, for benchmarks.

httpx costs more CPU per chunk than the proxy under test; on a 2-core machine the load generator
must not be the bottleneck. This client writes one request, then only timestamps reads and counts
content markers in them: no chunked-encoding parsing, no JSON, no SSE framing.
"""
from __future__ import annotations

import asyncio
import re
import time

import orjson

CONTENT = re.compile(rb'"content": ?"(?!")')  # a non-empty content delta, compact or spaced JSON
END = b"0\r\n\r\n"


class Connection:
    def __init__(self, host: str, port: int, path_prefix: str, headers: dict[str, str]) -> None:
        self.host, self.port, self.prefix = host, port, path_prefix
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def stream(self, body: dict[str, object], headers: dict[str, str] | None = None) -> tuple[float, list[float], int]:
        """(start, arrival time of each content chunk, status) for one streaming request; on a new
        connection the start is before the connect, so TTFT includes the TCP handshake and accept."""
        payload = orjson.dumps(body)
        extra = self.extra + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (f"POST {self.prefix}/chat/completions HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(payload)}\r\n{extra}\r\n").encode() + payload
        start = time.perf_counter()
        if self.writer is None:
            await self._open()
        assert self.writer is not None and self.reader is not None
        self.writer.write(request)
        arrivals: list[float] = []
        status = 0
        tail = b""
        while True:
            data = await self.reader.read(65536)
            now = time.perf_counter()
            if not data:
                self.writer = None
                break
            if not status:
                status = int(data[9:12])
            arrivals.extend([now] * len(CONTENT.findall(data)))
            tail = (tail + data)[-16:]
            if tail.endswith(END):
                break
        return start, arrivals, status

    async def complete(self, body: dict[str, object]) -> tuple[float, float, int]:
        """(start, end, status) for one non-streaming request (content-length framed)."""
        if self.writer is None:
            await self._open()
        payload = orjson.dumps(body)
        request = (f"POST {self.prefix}/chat/completions HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(payload)}\r\n{self.extra}\r\n").encode() + payload
        start = time.perf_counter()
        assert self.writer is not None and self.reader is not None
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = None
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if length is not None:
            await self.reader.readexactly(length)
        else:  # chunked
            await self.reader.readuntil(END)
        return start, time.perf_counter(), status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
