"""The floor of a relay written in Python: what the language and its event loop cost, without our layers.

    .venv/bin/python -m bench.relay floor PORT UPSTREAM_PORT [--asgi]

A plain HTTP/1.1 relay to one upstream on loopback, on the proxy's own parts (uvloop, httptools):
the client's request parsed, sent on a pooled upstream connection, the response's head and each
piece of its body written back as they are read (chunked framing kept), nothing measured, nothing
parsed, no ASGI. `--asgi` is the same relay as an ASGI app under uvicorn (httptools, uvloop), the
server the proxy runs on: the difference is what uvicorn and the ASGI cycle cost. Not a product:
no timeouts, no errors mapped, no limits. bench/relay/layers.py runs it beside Envoy and the proxy.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable

import httptools

HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host", b"upgrade", b"te", b"trailer"}


class Upstream(asyncio.Protocol):
    """One pooled upstream connection; the response's events go to `sink` (set per request)."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.transport, self.headers = pool, None, []
        self.sink: Callable[..., None] | None = None
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)

    def on_message_begin(self) -> None:
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.sink is not None
        self.sink("head", self.parser.get_status_code(), self.headers)

    def on_body(self, body: bytes) -> None:
        assert self.sink is not None
        self.sink("body", body)

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        self.pool.idle.append(self)
        assert sink is not None
        sink("end")


class Pool:
    def __init__(self, port: int) -> None:
        self.port, self.idle = port, []  # type: list[Upstream]

    async def send(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                   sink: Callable[..., None]) -> None:
        upstream = None
        while self.idle and upstream is None:
            candidate = self.idle.pop()
            upstream = None if candidate.transport.is_closing() else candidate
        if upstream is None:
            _, upstream = await asyncio.get_running_loop().create_connection(lambda: Upstream(self), "127.0.0.1", self.port)
        upstream.sink = sink
        head = [method, b" ", target, b" HTTP/1.1\r\nhost: 127.0.0.1\r\n"]
        for name, value in headers:
            if name.lower() not in HOP:
                head += [name, b": ", value, b"\r\n"]
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        upstream.transport.write(b"".join(head) + body)


class Client(asyncio.Protocol):
    """The client's side, straight on the transport: no ASGI."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.parser = pool, httptools.HttpRequestParser(self)
        self.chunked = self.keep = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        asyncio.get_running_loop().create_task(self.pool.send(self.parser.get_method(), self.url, self.headers, b"".join(self.body), self.event))

    def event(self, kind: str, *args: Any) -> None:
        write = self.transport.write
        if kind == "body":
            write(b"%x\r\n%b\r\n" % (len(args[0]), args[0]) if self.chunked else args[0])
        elif kind == "head":
            status, headers = args
            self.chunked = any(name.lower() == b"transfer-encoding" for name, _ in headers)
            head = [b"HTTP/1.1 %d OK\r\n" % status]
            for name, value in headers:
                if name.lower() not in (b"connection", b"keep-alive", b"transfer-encoding"):
                    head += [name, b": ", value, b"\r\n"]
            head.append(b"transfer-encoding: chunked\r\n\r\n" if self.chunked else b"\r\n")
            write(b"".join(head))
        else:
            if self.chunked:
                write(b"0\r\n\r\n")
            if not self.keep:
                self.transport.close()


def asgi_app(pool: Pool) -> Callable[..., Any]:
    """The same relay as an ASGI app: the body read with `receive`, the head, each piece and the end with `send`."""

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        await pool.send(scope["method"].encode(), scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b""),
                        scope["headers"], b"".join(parts), lambda *event: events.put_nowait(event))
        while True:
            event = await events.get()
            if event[0] == "head":
                await send({"type": "http.response.start", "status": event[1],
                            "headers": [(name.lower(), value) for name, value in event[2] if name.lower() not in HOP]})
            elif event[0] == "body":
                await send({"type": "http.response.body", "body": event[1], "more_body": True})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return

    return app


def main() -> None:
    import uvloop

    port, upstream_port = int(sys.argv[1]), int(sys.argv[2])
    pool = Pool(upstream_port)
    if "--asgi" in sys.argv:
        import uvicorn

        uvicorn.run(asgi_app(pool), host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="error",
                    access_log=False, lifespan="off", server_header=False, date_header=False)
        return

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: Client(pool), "127.0.0.1", port)
        await server.serve_forever()

    uvloop.install()
    asyncio.run(serve())


if __name__ == "__main__":
    main()
