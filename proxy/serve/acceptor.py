"""Accepting client connections: the event loop's listener, replaced so exhaustion is never a reset.

Why: when a process has no file descriptor left, libuv (under uvloop) accepts each waiting
connection and closes it at once (its "EMFILE trick"), so in a burst above the descriptor limit
every client beyond it sees a reset connection, with no status and no reason. `Acceptor` accepts
itself instead. Out of descriptors (or memory) at `accept`, it stops accepting for `RETRY_S`: the
clients wait in the kernel's listen backlog and are served as descriptors free up (nginx does the
same). Once accepted, a request that cannot get an upstream connection for want of a descriptor
is answered `503 proxy_overloaded` by the relay. `ProxyLoop` is uvloop's loop with this listener; uvicorn is given its factory
(`--loop proxy.serve.acceptor:new_event_loop`), so every worker and the admin port use it.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Callable

import uvloop

from ..errors import EXHAUSTED

log = logging.getLogger("llmproxy.acceptor")

RETRY_S = 0.05  # how long accepting pauses when the process is out of descriptors or memory
BATCH = 64  # connections accepted per wake-up before other ready work runs


class Acceptor:
    """A listening socket served by our own accept loop; quacks like asyncio.Server for uvicorn."""

    def __init__(self, loop: "ProxyLoop", sock: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        self.loop, self.sock, self.factory = loop, sock, factory
        sock.setblocking(False)
        self.sockets = [sock]
        self.serving = True
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in EXHAUSTED:
                    raise
                self._pause(EXHAUSTED[exc.errno][0])
                return
            task = self.loop.create_task(self._adopt(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        """uvloop adopts the accepted socket as it is (no second descriptor: tests/test_acceptor.py) and makes it
        non-blocking itself (libuv's `uv_tcp_open`: a `setblocking` here would be a second system call for it)."""
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except OSError:
            conn.close()
            log.exception("could not adopt an accepted connection")

    def _pause(self, reason: str) -> None:
        if self._retry is not None or not self.serving:
            return
        self.loop.paused(reason)
        self.loop.remove_reader(self.sock.fileno())
        self._retry = self.loop.call_later(RETRY_S, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if self.serving:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    # -- what uvicorn uses of an asyncio.Server -------------------------------------------------
    def close(self) -> None:
        if not self.serving:
            return
        self.serving = False
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        else:
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def is_serving(self) -> bool:
        return self.serving

    async def wait_closed(self) -> None:
        return None


class ProxyLoop(uvloop.Loop):
    """uvloop, with `create_server` served by an `Acceptor` (plain TCP; anything else as uvloop does)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_pause: Callable[[str], None] | None = None  # set by the app at start-up: counts pauses

    def paused(self, reason: str) -> None:
        log.warning("out of %s: not accepting new connections for %.0f ms (they wait in the listen backlog)", reason, RETRY_S * 1000)
        if self.on_pause is not None:
            try:
                self.on_pause(reason)
            except Exception:  # noqa: BLE001 - counting must not stop accepting
                log.exception("counting an accept pause failed")

    async def create_server(self, factory: Callable[[], asyncio.Protocol], host: Any = None, port: Any = None, *,  # type: ignore[override]
                            sock: socket.socket | None = None, backlog: int = 100, ssl: Any = None, **kwargs: Any) -> Any:
        if ssl is not None or kwargs or (sock is not None and sock.family not in (socket.AF_INET, socket.AF_INET6)):
            return await super().create_server(factory, host, port, sock=sock, backlog=backlog, ssl=ssl, **kwargs)
        if sock is None:
            host = host or ""
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=backlog,
                                        dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        else:
            sock.listen(backlog)
        return Acceptor(self, sock, factory)


def new_event_loop() -> ProxyLoop:
    """uvicorn's loop factory (`loop="proxy.serve.acceptor:new_event_loop"`)."""
    return ProxyLoop()
