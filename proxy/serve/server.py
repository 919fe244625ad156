"""Running the proxy under uvicorn: workers, the admin port, graceful shutdown, slowloris guard.

uvicorn bounds idle keep-alive connections but not the time a client takes to send its request
headers, so a client trickling one header byte a second holds a connection forever (slowloris).
`GuardedHttpTools` closes a connection whose headers are not complete `--header-timeout` seconds
after it opened or after its request began (armed only when a read ends with a request's head
incomplete: a keep-alive request whose head came whole, the usual case, arms and cancels no timer).
It also stamps, in the protocol callback, when a
request's first byte and its body's last byte reached the socket (the kernel's stamp, when the loop
read them late) and when the loop read the body's end (`STAMPS` in the scope's extensions): the
request's `received_ns`, the end of the client's upload and the proxy's lag behind it. Stamped when the
request's task first runs instead, a burst's later requests would hide the time they waited
behind the earlier ones, which is the proxy's own time. It tells the relay when a client leaves
mid-request (the "lost" stamp: no task per request waiting on the ASGI receive), and takes a
connection's addresses from uvloop, which read them at the accept. On SIGTERM uvicorn stops accepting connections at
once and lets in-flight requests finish for `--shutdown-grace` seconds. The event loop is uvloop
with our own listener (`acceptor.py`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import Any, Callable

import uvicorn
from uvicorn.logging import TRACE_LOG_LEVEL
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import is_ssl

from ..config import Settings
from ..measure.arrival import arrived_ns
from ..measure.timing import STAMPS, now_ns
from ..upstream.pump import BodyWriter

HEADER_TIMEOUT_ENV = "LLMPROXY_HEADER_TIMEOUT"
MAX_BLOCKED = 64  # pause intervals kept per request (later ones are merged into the last)
log = logging.getLogger("llmproxy.server")


class GuardedHttpTools(HttpToolsProtocol):
    """httptools protocol with a deadline for receiving request headers."""

    header_timeout = 10.0  # replaced from the environment in each process (workers too)

    def connection_made(self, transport: Any) -> None:
        """uvicorn's, but for the addresses: uvloop read them once at the accept (`get_extra_info`), where uvicorn's
        asks uvloop for its socket object, makes one per address and asks the kernel again (five system calls a connection)."""
        self._read_ns = now_ns()
        self.connections.add(self)
        self.transport, self.flow = transport, FlowControl(transport)
        local = transport.get_extra_info("sockname")
        self.server = address(local) or ((local, None) if isinstance(local, str) else None)  # (a Unix socket: its path)
        self.client = address(transport.get_extra_info("peername"))
        self.scheme = "https" if is_ssl(transport) else "http"
        if self.logger.level <= TRACE_LOG_LEVEL:
            self.logger.log(TRACE_LOG_LEVEL, "%sHTTP connection made", "%s:%d - " % self.client if self.client else "")
        self._header_timer: asyncio.TimerHandle | None = None
        self._heading = False  # a request began and its headers are not complete yet
        self._stamps: dict[str, Any] = {}
        self._lost: set[Callable[[], None]] = set()  # the relay's, told when the client leaves mid-request
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._read_ns = now_ns()
        super().data_received(data)
        if self._heading and self._header_timer is None:
            self._arm()  # (a request's head left incomplete by this read: its deadline runs from now)

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.warning("closing a connection whose request headers took over %.1f s", self.header_timeout)
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # "lost": the relay's callbacks for a client that leaves mid-request, instead of a task per request waiting
        # on the ASGI receive for http.disconnect (the set refers to no protocol: no cycle for the collector)
        # (when the bytes reached the socket, by the kernel: arrival.py; a loop late to them, e.g. under a CPU quota,
        # must not make the client's upload look slow or its request look quick)
        self._stamps = {"first_byte_ns": arrived_ns(self.transport.get_extra_info("socket"), self._read_ns), "body_end_ns": 0,
                        "body_seen_ns": 0, "blocked": [], "paused_ns": 0, "lost": self._lost}
        self.scope["extensions"] = {STAMPS: self._stamps}  # type: ignore[dict-item]
        self._heading = True  # (the deadline is armed only if this read ends before the headers do: data_received)

    def pause_writing(self) -> None:
        """The client stopped taking bytes as fast as they come: stamped, as the relay's wait on it."""
        super().pause_writing()
        if not self._stamps.get("paused_ns"):
            self._stamps["paused_ns"] = now_ns()

    def resume_writing(self) -> None:
        super().resume_writing()
        paused = self._stamps.get("paused_ns")
        if paused:
            blocked: list[tuple[int, int]] = self._stamps["blocked"]
            if len(blocked) < MAX_BLOCKED:
                blocked.append((paused, now_ns()))
            else:
                blocked[-1] = (blocked[-1][0], now_ns())
            self._stamps["paused_ns"] = 0

    def on_message_complete(self) -> None:
        self._stamps["body_end_ns"] = arrived_ns(self.transport.get_extra_info("socket"), self._read_ns)
        self._stamps["body_seen_ns"] = self._read_ns
        super().on_message_complete()
        if not self.pipeline:
            # Reading resumes, as the ASGI receive would once the app took the body (uvicorn pauses it past 64 KB of
            # body): a client's close is seen only by reading, and the relay waits on no receive (the "lost" stamp).
            self.flow.resume_reading()

    def on_headers_complete(self) -> None:
        self._heading = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_headers_complete()
        self._stamps["writer"] = BodyWriter(self, self.cycle)  # (this request's cycle: a pipelined next one gets its own)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)
        for lost in list(self._lost):
            lost()


def address(info: Any) -> tuple[str, int] | None:
    """uvicorn's (host, port) of an IP address as uvloop keeps it (IPv4's pair, IPv6's four)."""
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


GuardedHttpTools.header_timeout = float(os.environ.get(HEADER_TIMEOUT_ENV, GuardedHttpTools.header_timeout))


class QuietServer(uvicorn.Server):
    """uvicorn's server without its 100 ms tick. uvicorn wakes ten times a second to see whether it
    should exit (and to refresh a Date header we do not send): 2.6 ms of CPU a second here, idle or
    not, a quarter of the relay's CPU per chunk at one stream. This one sleeps until `should_exit`
    is set: by its signal handler, or by our code (the admin server at shutdown)."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _exit = False

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        if value and self._wake is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)  # (safe from a signal handler, or another thread)

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while not await self.on_tick(0):  # (counter 0: its once-a-second work each time it wakes)
            await self._wake.wait()
            self._wake.clear()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    # uvloop with our own listener, which never resets a client when descriptors run out (acceptor.py).
    return {"loop": "proxy.serve.acceptor:new_event_loop", "http": GuardedHttpTools, "log_level": settings.log_level, "access_log": False,
            "timeout_graceful_shutdown": settings.shutdown_grace, "proxy_headers": False,
            # The upstream's own Date and Server headers pass through; adding ours would duplicate them.
            "server_header": False, "date_header": False}


def run(settings: Settings) -> None:
    from .. import build

    hot, stale = build.compiled(), build.stale()
    log.info("hot path %s", f"compiled (mypyc): {', '.join(hot)}" if hot else "interpreted (no compiled build: 6-16% more CPU per chunk)")
    if stale:
        log.warning("%s changed after its compiled build, which runs instead: reinstall (make install)", ", ".join(stale))
    os.environ[HEADER_TIMEOUT_ENV] = str(settings.header_timeout)
    GuardedHttpTools.header_timeout = settings.header_timeout
    if settings.workers > 1:
        # Multiprocess metrics: a fresh, empty directory before any prometheus_client import.
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="llmproxy-prom-")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        from .app import SETTINGS_ENV

        os.environ[SETTINGS_ENV] = settings.to_json()
        uvicorn.run("proxy.serve.app:app_from_env", factory=True, host=settings.host, port=settings.port,
                    workers=settings.workers, **uvicorn_options(settings))
        return
    from .app import create_app

    app = create_app(settings)
    main = QuietServer(uvicorn.Config(app, host=settings.host, port=settings.port, **uvicorn_options(settings)))
    if not settings.admin_port:
        main.run()
        return
    admin = QuietServer(uvicorn.Config(app.admin, host=settings.host, port=settings.admin_port, lifespan="off",
                                          **uvicorn_options(settings)))

    async def both() -> None:
        admin_task = asyncio.create_task(admin.serve())
        await main.serve()
        admin.should_exit = True
        await admin_task

    from .acceptor import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(both())
