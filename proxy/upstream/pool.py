"""The pool of connections to one upstream, and the timing of each network step. It knows nothing of the fleet: a
replica's health, forecast and prefix index are the fleet's, which owns a pool per replica (fleet/replica.py).

Connections are `upstream/connection.py`'s `Connection` protocols on the event loop (uvloop under the
server). Each step is stamped here, in the one place that performs it: the pool (a slot and a
pooled connection: a wait here is the proxy's own, the phase `wait`, never network), DNS (resolved by us, so it is timed apart from TCP), TCP connect, TLS handshake
(`loop.start_tls` on the connected socket, so it is timed apart from TCP), request sent and
response headers. After the headers we read the kernel's smoothed RTT for the very socket the
request used (Linux TCP_INFO): on its first request, then at most once per `RTT_EVERY_NS` of the
connection (the figure is the kernel's moving average already; reading it is a system call, 15-20 µs
of a request under load, bench/RESULTS.md).

Idle connections: one the upstream closes is closed by us at once (the protocol sees the FIN), so
none lingers in CLOSE-WAIT; one idle for `--keepalive-expiry` seconds is closed by a sweep, so a
burst's connections do not pin descriptors against an upstream that never closes idle ones. The
idle list is LIFO (reuse the warmest), so its bottom holds the oldest: the sweep is one timer, set
for the oldest connection's expiry, that pops expired ones off the bottom. Nothing is done per chunk.
A pooled connection can still be closed by the upstream while our request is on its way (its FIN or
reset not yet read; llama.cpp closes every connection after a stream, whatever its keep-alive
header says): when not a byte of an answer came back on it, the request is sent once more on a new
connection (`stale`, counted as llmproxy_upstream_connections_total{reused="stale"}), never more. A
server that took the request and died without a byte would see it twice; its new connection is then
refused, which is the answer the client gets.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from typing import Any, Awaitable, Callable

from ..config import Settings
from ..errors import (ConnectError, ConnectTimeout, EgressError, ProxyOverloaded, ReadError, RemoteProtocolError, TransportError,
                      WriteError, WriteTimeout)
from ..measure import arrival
from ..measure.arrival import socket_rtt_s
from ..measure.timing import RequestTiming, now_ns
from . import egress
from .connection import Budget, Connection
from .limits import pool_size

RTT_EVERY_NS = 1_000_000_000  # a pooled connection's RTT is read again after this long


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


Resolver = Callable[..., Awaitable[list[Any]]]


class Pool:
    """The pool to one upstream base URL, with the settings' timeouts."""

    def __init__(self, settings: Settings, budget: Budget | None = None) -> None:
        self.settings = settings  # this upstream's own (--upstream, or its entry in the routing file)
        # What every stream reads ahead of a slow client: per stream, and shared by the whole process.
        self.budget = budget or Budget(settings.stream_buffer_bytes, settings.stream_buffer_total_bytes)
        self.key = settings.upstream_api_key.encode() if settings.upstream_api_key else None  # replaces the client's
        self.first_token_timeout, self.read_timeout = settings.first_token_timeout, settings.read_timeout
        scheme, host, port, base_path = settings.upstream_parts
        self.scheme, self.host, self.port, self.base_path = scheme, host, port, base_path
        self.prefix = base_path[:-3] if base_path.endswith("/v1") else base_path  # the base path without its /v1
        self.host_header = host if port in (80, 443) else f"{host}:{port}"
        self.label = settings.upstream_label
        # Learned: the upstream puts per-request token counts in its streams itself (llama.cpp's
        # `timings`), so asking it for include_usage is unnecessary (and would move its fields).
        self.reports_counts = False
        # Learned: the upstream answers 400 to `stream_options` (older Azure OpenAI api-versions).
        self.rejects_stream_options = False
        # Waiting for the response is bounded by the relay (first-token and read limits).
        self.connect_timeout, self.write_timeout, self.pool_timeout = settings.connect_timeout, settings.write_timeout, settings.pool_timeout
        self.ssl_context = ssl.create_default_context(cafile=settings.ca_bundle or None) if scheme == "https" else None
        # A company's forward proxy (egress.py): a CONNECT tunnel to an https upstream, absolute-form requests to an http one.
        self.egress = egress.choose(scheme, host, port, settings.upstream_proxy)
        self.absolute = self.egress is not None and scheme == "http"
        self.resolver: Resolver | None = None  # None: the event loop's getaddrinfo (tests inject failures here)
        self.keepalive_expiry = settings.keepalive_expiry
        # One LIFO list of idle connections, oldest first: checkout pops the newest, the sweep
        # closes expired ones from the front.
        self._idle: list[Connection] = []
        self._sweep_timer: asyncio.TimerHandle | None = None
        # The pool's size: --max-connections, else as many streams as the process can hold (limits.py).
        self.limit = pool_size(settings)
        self.limited_by = ("--max-connections" if settings.max_connections > 0 else "--max-in-flight" if settings.max_in_flight > 0
                           else "the open files limit")
        self._slots = asyncio.Semaphore(self.limit)
        self.in_use = 0  # connections lent out now (the pool gauges, read at the scrape)

    def target(self, path: str, query: bytes) -> bytes:
        """The upstream's request target for the client's `path` (the query string goes as it came):

        - the path goes below the base path less a final `/v1` (`http://h/v1` or `http://h` +
          `/v1/chat/completions` → `/v1/chat/completions`; `http://h:11434/v1` + `/api/tags` →
          `/api/tags`; `https://r.openai.azure.com/openai/v1` + `/v1/chat/completions` →
          `/openai/v1/chat/completions`), unless it already starts with that (the same base +
          `/openai/deployments/d/chat/completions` goes as is);
        - a base path that does not end in `/v1` stands for the client's `/v1`
          (`http://h/api/openai/v1beta` + `/v1/chat/completions` → `/api/openai/v1beta/chat/completions`).
        """
        if path.startswith("/v1/") and self.base_path and self.prefix == self.base_path:
            target = self.base_path + path[3:]
        elif self.prefix and not (path == self.prefix or path.startswith(self.prefix + "/")):
            target = self.prefix + path
        else:
            target = path
        raw = target.encode()
        if self.absolute:  # through an egress proxy to an http upstream: the proxy needs the whole URL
            raw = f"http://{self.host_header}".encode() + raw
        return raw + b"?" + query if query else raw

    async def send(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                   timing: RequestTiming) -> Connection:
        """Send and return once the response headers arrived; the caller reads the body, then
        hands the connection back with `release` (always: it also frees the pool slot)."""
        timing.issued_ns = now_ns()
        if self._slots.locked():  # the pool is full: the proxy's own limit, never the upstream's fault
            timing.pool_full = True
            if self.pool_timeout <= 0:
                raise ProxyOverloaded("pool", f"all {self.limit} connections to {self.label} in use, the limit set by {self.limited_by}")
            try:
                async with asyncio.timeout(self.pool_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise ProxyOverloaded("pool", f"all {self.limit} connections to {self.label} stayed in use for --pool-timeout "
                                              f"{self.pool_timeout:g} s") from None
        else:
            await self._slots.acquire()
        self.in_use += 1
        connection = None
        try:
            if self.absolute and self.egress is not None and self.egress.authorization:
                headers = [*headers, (b"proxy-authorization", self.egress.authorization)]
            head = _head(method, target, headers)
            connection = self._checkout()
            timing.first_event_ns = now_ns()
            while True:
                pooled = connection is not None
                if connection is None:
                    connection = await self._connect(timing)
                timing.send_start_ns = now_ns()
                seen = connection.seen_ns
                try:
                    if connection.write(head, body):
                        try:
                            async with asyncio.timeout(self.write_timeout):
                                await connection.drain()
                        except TimeoutError:
                            raise WriteTimeout("timed out sending the request") from None
                    sent = timing.sent_ns = now_ns()
                    await connection.response_head()
                    break
                except (WriteError, ReadError, RemoteProtocolError):
                    if not pooled or connection.seen_ns != seen:
                        raise
                    # A pooled connection the upstream closed as the request went out, not a byte of an answer
                    # on it: llama.cpp closes after every stream though its answer says keep-alive, and its FIN
                    # can trail the stream's end. Sent once more, on a new connection (module docstring).
                    connection.abort()
                    connection, timing.stale = None, True
            timing.headers_ns = max(sent, connection.headers_ns)  # read off the socket, not when this task woke
        except BaseException:
            self._slots.release()
            self.in_use -= 1
            if connection is not None:
                connection.abort()
            raise
        if method == "HEAD":
            connection.head_only()
        if connection.transport is not None:
            if not connection.rtt_ns or sent - connection.rtt_ns >= RTT_EVERY_NS:
                connection.rtt_s, connection.rtt_ns = socket_rtt_s(connection.sock or connection.transport.get_extra_info("socket")), sent
            timing.rtt_s = connection.rtt_s
        return connection

    def _checkout(self) -> Connection | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable(now):
                return connection
            connection.close()
        return None

    async def _connect(self, timing: RequestTiming) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await self._open(loop, timing)
        except TimeoutError:
            raise ConnectTimeout(f"timed out after {self.connect_timeout} s connecting to {self.host}:{self.port}") from None

    async def _open(self, loop: asyncio.AbstractEventLoop, timing: RequestTiming) -> Connection:
        proxy = self.egress
        host, port = (proxy.host, proxy.port) if proxy is not None else (self.host, self.port)  # (DNS and TCP: to the proxy)
        addresses = [host]
        if not _is_ip(host):
            timing.dns_start_ns = now_ns()
            resolve = self.resolver or loop.getaddrinfo
            try:
                infos = await resolve(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ConnectError(f"DNS lookup of {host} failed: {exc}") from exc
            timing.dns_end_ns = now_ns()
            addresses = [str(info[4][0]) for info in infos] or addresses
        last: Exception | None = None
        for address in addresses:
            timing.tcp_start_ns = started = now_ns()
            try:
                transport, connection = await loop.create_connection(lambda: Connection(loop, self.budget), address, port)
                break
            except OSError as exc:
                last = exc
        else:
            if proxy is not None:
                raise EgressError(f"the egress proxy {proxy.where}: {last or 'no address'}") from last
            raise ConnectError(f"{last or 'no address'}") from last
        # Connected when the SYN-ACK came, by the kernel's first RTT sample; not when this task woke (a loop
        # late by a CPU quota would book its own delay as network).
        timing.tcp_end_ns = timing.tcp_seen_ns = now_ns()
        handshake_s = arrival.socket_rtt_s(connection.sock)  # (the connect's own sample; a request's RTT: socket_rtt_s, below)
        if handshake_s and started + int(handshake_s * 1e9) < timing.tcp_end_ns:
            timing.tcp_end_ns = started + int(handshake_s * 1e9)
        if proxy is not None and self.ssl_context is not None:
            timing.proxy_start_ns = now_ns()
            try:
                await self._tunnel(connection, proxy)
            except BaseException:
                transport.abort()
                raise
            timing.proxy_end_ns = now_ns()
        if self.ssl_context is not None:
            timing.tls_start_ns = now_ns()
            try:  # (through a tunnel too: end to end, the certificate checked against the upstream's name)
                tls = await loop.start_tls(transport, connection, self.ssl_context, server_hostname=self.host)
            except (ssl.SSLError, OSError) as exc:
                transport.abort()
                raise ConnectError(f"TLS handshake failed: {exc}") from exc
            if tls is None:
                raise ConnectError("TLS handshake failed: the transport closed")
            connection.transport = tls
            timing.tls_end_ns = now_ns()
        return connection

    async def _tunnel(self, connection: Connection, proxy: egress.EgressProxy) -> None:
        """`CONNECT host:port` through the egress proxy; the connection then carries the upstream's bytes."""
        authority = f"{self.host}:{self.port}".encode()
        head = b"CONNECT " + authority + b" HTTP/1.1\r\nHost: " + authority + b"\r\n"
        if proxy.authorization:
            head += b"Proxy-Authorization: " + proxy.authorization + b"\r\n"
        connection.write(head + b"\r\n", b"")
        try:
            await connection.response_head()
        except TransportError as exc:
            raise EgressError(f"the egress proxy {proxy.where} closed the connection during CONNECT: {exc}") from None
        if connection.status != 200:
            raise EgressError(f"the egress proxy {proxy.where} answered {connection.status} to CONNECT {authority.decode()}")
        connection.tunnelled()

    def release(self, connection: Connection) -> None:
        """Give the connection back: pooled if the response was read whole and the upstream keeps
        it open, else closed (mid-body: aborted, which makes an engine such as vLLM stop generating)."""
        self._slots.release()
        self.in_use -= 1
        now = connection.loop.time()
        connection.expires_at = now + self.keepalive_expiry
        if connection.reusable(now):
            self._idle.append(connection)
            if self._sweep_timer is None:
                self._sweep_timer = connection.loop.call_at(connection.expires_at, self._sweep, connection.loop)
        elif connection.complete:
            connection.close()
        else:
            connection.abort()

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the idle connections whose expiry has come (a timer may fire a hair early: 10 ms slack)."""
        self._sweep_timer = None
        idle, horizon = self._idle, loop.time() + 0.01
        expired = 0
        while expired < len(idle) and idle[expired].expires_at <= horizon:
            idle[expired].close()
            expired += 1
        del idle[:expired]
        if idle:
            self._sweep_timer = loop.call_at(idle[0].expires_at, self._sweep, loop)

    @property
    def idle(self) -> int:
        """Pooled connections waiting for a request now."""
        return len(self._idle)

    def close(self) -> None:
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        for connection in self._idle:
            connection.close()
        self._idle.clear()


def _head(method: str, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    parts = [method.encode(), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)
