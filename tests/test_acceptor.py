"""The listener under real EMFILE: this process's descriptors are all taken (its soft limit lowered
to its highest open descriptor, every free one below filled), so the kernel refuses `accept`, as it
would in a burst above the limit."""
from __future__ import annotations

import asyncio
import socket

from servers import descriptors_exhausted
from proxy.serve.acceptor import Acceptor, ProxyLoop, new_event_loop


class Hello(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"hello")  # type: ignore[attr-defined]
        transport.close()


def run(coro) -> None:  # type: ignore[no-untyped-def]
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(coro)


async def listen(pauses: list[str]) -> tuple[ProxyLoop, Acceptor, int]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, ProxyLoop)
    loop.on_pause = pauses.append
    server = await loop.create_server(Hello, "127.0.0.1", 0, backlog=16)
    assert isinstance(server, Acceptor)
    return loop, server, server.sockets[0].getsockname()[1]


def test_out_of_descriptors_at_accept_the_client_waits_in_the_backlog_and_is_served_after():
    pauses: list[str] = []

    async def main() -> None:
        loop, server, port = await listen(pauses)
        client = socket.socket()
        client.setblocking(False)
        with descriptors_exhausted():
            client.connect_ex(("127.0.0.1", port))  # the kernel completes it into the listen backlog
            await asyncio.sleep(0.3)  # accept fails with EMFILE, again after each 50 ms pause
            assert "descriptors" in pauses
        data = await asyncio.wait_for(loop.sock_recv(client, 100), 2.0)
        assert data == b"hello"  # accepted and served once a descriptor was free: never reset
        client.close()
        server.close()

    run(main())


def test_a_connection_accepted_with_the_last_descriptor_is_served():
    """uvloop adopts an accepted socket without duplicating it, so the last descriptor is enough
    (were it to duplicate, this client would be reset: a premise of acceptor.py)."""
    pauses: list[str] = []

    async def main() -> None:
        loop, server, port = await listen(pauses)
        client = socket.socket()
        client.setblocking(False)
        with descriptors_exhausted(spare=1):
            client.connect_ex(("127.0.0.1", port))
            data = await asyncio.wait_for(loop.sock_recv(client, 100), 2.0)
        assert data == b"hello"
        client.close()
        server.close()

    run(main())


def test_the_server_protocol_gives_the_scope_the_addresses_uvicorns_would():
    """server.py's `connection_made` takes the connection's addresses from uvloop (read once at the accept), not
    from a socket object per address as uvicorn's does: the scope's `client` and `server` are still the socket's
    own, over IPv4 and IPv6."""
    import uvicorn

    from proxy.serve.server import GuardedHttpTools, QuietServer

    seen: list[tuple[object, object]] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            seen.append((scope["client"], scope["server"]))
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def main(host: str) -> None:
        config = uvicorn.Config(app, host=host, port=0, http=GuardedHttpTools, lifespan="off", log_level="warning")
        server = QuietServer(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 204")
        mine, theirs = writer.get_extra_info("sockname"), writer.get_extra_info("peername")
        writer.close()
        server.should_exit = True
        await task
        assert seen[-1] == ((mine[0], mine[1]), (theirs[0], theirs[1]))

    run(main("127.0.0.1"))
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return  # (no IPv6 loopback here)
    run(main("::1"))
    assert len(seen) == 2


def test_the_server_protocols_connection_made_sets_what_uvicorns_sets():
    """server.py replaces uvicorn's `connection_made` (for the addresses): on one real connection, every attribute
    uvicorn's sets is set here too, to the same value (a uvicorn that set more would fail this)."""
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from proxy.serve.server import GuardedHttpTools

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        return None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        config.load()
        state = ServerState()
        with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_connection(listener.getsockname()) as client:
            conn, _ = listener.accept()
            ours, theirs = GuardedHttpTools(config, state, {}, _loop=loop), HttpToolsProtocol(config, state, {}, _loop=loop)
            transport, _ = await loop.connect_accepted_socket(lambda: ours, conn)
            HttpToolsProtocol.connection_made(theirs, transport)
            mine, base = vars(ours), vars(theirs)
            assert set(base) <= set(mine)
            for key, value in base.items():
                if key == "flow":
                    assert type(mine[key]) is type(value) and mine[key]._transport is value._transport
                elif key != "parser":  # (each its own)
                    assert mine[key] == value, key
            assert mine["client"] == client.getsockname() and mine["server"] == client.getpeername()
            transport.close()
            await asyncio.sleep(0)

    run(main())
