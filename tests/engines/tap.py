"""A TCP tap on loopback: forwards bytes both ways and records what the server sent.

Put between the proxy and an engine, it shows the exact response bytes the proxy received, so a
test can compare them with what the proxy's client received.
"""
from __future__ import annotations

import asyncio
import threading


class Tap:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.responses: list[bytearray] = []  # per connection, everything the server sent
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.port = 0

        async def start() -> None:
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        ready.wait(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        record = bytearray()
        self.responses.append(record)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, sink: bytearray | None) -> None:
            try:
                while data := await src.read(65536):
                    if sink is not None:
                        sink.extend(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, None), pipe(up_reader, writer, record))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)


def http_body(raw: bytes) -> bytes:
    """The body of the first HTTP/1.1 response in `raw`, de-chunked."""
    head, _, rest = bytes(raw).partition(b"\r\n\r\n")
    headers = head.lower()
    if b"transfer-encoding: chunked" not in headers:
        length = int(next(line.split(b":")[1] for line in headers.split(b"\r\n") if line.startswith(b"content-length")))
        return rest[:length]
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body.extend(rest[:size])
        rest = rest[size + 2 :]
