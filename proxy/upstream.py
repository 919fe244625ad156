"""The connection pool to the upstream and the hooks that time each network step.

We drive httpcore directly (httpx's own transport layer): its `trace` extension reports each I/O
step, and its pluggable network backend lets us resolve DNS ourselves so DNS and TCP are timed
apart. A reused connection fires no connect event; the pool wait is the gap from issuing the
request to the first event. After the response headers we read the kernel's smoothed RTT for the
very socket the request used (Linux TCP_INFO).
"""
from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import socket
import ssl
import struct
from typing import Any, Awaitable, Callable, Iterable

import anyio
import anyio.streams.tls  # noqa: F401 - imported now, not lazily inside the first request
import httpcore

from .config import Settings
from .timing import RequestTiming, now_ns

current_timing: contextvars.ContextVar[RequestTiming | None] = contextvars.ContextVar("current_timing", default=None)

_TCP_INFO = getattr(socket, "TCP_INFO", None)
_TCPI_RTT_OFFSET = 68  # struct tcp_info: 8 bytes of u8 fields, then u32s; tcpi_rtt (µs) is the 16th


def socket_rtt_s(sock: socket.socket | None) -> float | None:
    """Smoothed RTT the kernel keeps for this TCP socket, in seconds (None off Linux)."""
    if sock is None or _TCP_INFO is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 104)
    except OSError:
        return None
    if len(raw) < _TCPI_RTT_OFFSET + 4:
        return None
    (rtt_us,) = struct.unpack_from("I", raw, _TCPI_RTT_OFFSET)
    return rtt_us / 1e6


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class TimedBackend(httpcore.AsyncNetworkBackend):
    """AnyIO backend that resolves names itself, so the DNS step has its own timestamps."""

    def __init__(self, resolver: Callable[..., Awaitable[list[Any]]] | None = None) -> None:
        self._inner = httpcore.AnyIOBackend()
        self.resolver = resolver  # None: the event loop's getaddrinfo (tests inject failures here)

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if _is_ip(host):
            return await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        timing = current_timing.get()
        if timing is not None:
            timing.dns_start_ns = now_ns()
        resolve = self.resolver or asyncio.get_running_loop().getaddrinfo
        try:
            infos = await asyncio.wait_for(resolve(host, port, type=socket.SOCK_STREAM), timeout)
        except asyncio.TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"DNS lookup of {host} timed out") from exc
        except socket.gaierror as exc:
            raise httpcore.ConnectError(f"DNS lookup of {host} failed: {exc}") from exc
        if timing is not None:
            timing.dns_end_ns = now_ns()
        last: Exception | None = None
        for info in infos:
            try:
                return await self._inner.connect_tcp(info[4][0], port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        raise last or httpcore.ConnectError(f"no address for {host}")

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class TraceHook:
    """httpcore trace callback for one request: writes instants into its timing record."""

    __slots__ = ("timing",)

    def __init__(self, timing: RequestTiming) -> None:
        self.timing = timing

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        t = self.timing
        now = now_ns()
        if t.first_event_ns is None:
            t.first_event_ns = now
        step = name.partition(".")[2]
        if step == "connect_tcp.started":
            t.tcp_start_ns = now
        elif step == "connect_tcp.complete":
            t.tcp_end_ns = now
        elif step == "start_tls.started":
            t.tls_start_ns = now
        elif step == "start_tls.complete":
            t.tls_end_ns = now
        elif step == "send_request_headers.started":
            t.send_start_ns = now
        elif step == "send_request_body.complete":
            t.sent_ns = now
        elif step == "receive_response_headers.complete":
            t.headers_ns = now


class Upstream:
    """The pool to one upstream base URL, with the settings' timeouts."""

    def __init__(self, settings: Settings) -> None:
        scheme, host, port, base_path = settings.upstream_parts
        self.scheme, self.host, self.port, self.base_path = scheme, host, port, base_path
        self.origin = f"{scheme}://{host}:{port}"
        self.host_header = host if port in (80, 443) else f"{host}:{port}"
        self.label = settings.upstream_label
        # Learned: the upstream puts per-request token counts in its streams itself (llama.cpp's
        # `timings`), so asking it for include_usage is unnecessary (and would move its fields).
        self.reports_counts = False
        # Learned: the upstream answers 400 to `stream_options` (older Azure OpenAI api-versions).
        self.rejects_stream_options = False
        self.timeouts = {
            "connect": settings.connect_timeout,
            # Response headers may wait for a whole prefill (or, non-streaming, the generation);
            # the relay enforces the tighter between-chunk limit itself.
            "read": max(settings.first_token_timeout, settings.read_timeout),
            "write": settings.write_timeout,
            "pool": settings.pool_timeout,
        }
        self.ssl_context = ssl.create_default_context(cafile=settings.ca_bundle or None) if scheme == "https" else None
        self.backend = TimedBackend()
        self.origin_model = httpcore.Origin(scheme.encode(), host.encode(), port)
        self.keepalive_expiry = 60.0
        # Our own pool of httpcore connections to the one upstream. httpcore's pool checks every
        # idle connection for readability (a syscall each) on every request: O(connections) per
        # request. Here one LIFO list, and only the connection about to be used is checked.
        self._idle: list[httpcore.AsyncHTTPConnection] = []
        self._slots = asyncio.Semaphore(settings.max_connections)
        self._in_use: dict[int, httpcore.AsyncHTTPConnection] = {}

    def url(self, path: str, query: bytes) -> bytes:
        """`path` is the client's path below /v1 (e.g. `/chat/completions`)."""
        target = f"{self.origin}{self.base_path}{path}".encode()
        return target + b"?" + query if query else target

    async def send(
        self, method: str, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes, timing: RequestTiming
    ) -> httpcore.Response:
        """Send and return once the response headers arrived; the body is streamed by the caller."""
        request = httpcore.Request(
            method,
            url,
            headers=headers,
            content=body,
            extensions={"timeout": self.timeouts, "trace": TraceHook(timing)},
        )
        token = current_timing.set(timing)
        timing.issued_ns = now_ns()
        try:
            async with asyncio.timeout(self.timeouts["pool"]):
                await self._slots.acquire()
        except TimeoutError:
            current_timing.reset(token)
            raise httpcore.PoolTimeout("no free upstream connection") from None
        connection = None
        try:
            connection = await self._checkout()
            response = await connection.handle_async_request(request)
        except BaseException:
            self._slots.release()
            if connection is not None:
                await connection.aclose()
            raise
        finally:
            current_timing.reset(token)
        self._in_use[id(response)] = connection
        stream = response.extensions.get("network_stream")
        if stream is not None:
            timing.rtt_s = socket_rtt_s(stream.get_extra_info("socket"))
        return response

    async def _checkout(self) -> httpcore.AsyncHTTPConnection:
        while self._idle:
            connection = self._idle.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection
            await connection.aclose()
        return httpcore.AsyncHTTPConnection(self.origin_model, ssl_context=self.ssl_context, keepalive_expiry=self.keepalive_expiry,
                                            network_backend=self.backend)

    async def release(self, response: httpcore.Response) -> None:
        """Close the response (mid-body: the connection closes, which makes vLLM abort) and give the
        connection back to the pool when it can serve another request."""
        connection = self._in_use.pop(id(response), None)
        try:
            await response.aclose()
        finally:
            if connection is not None:
                self._slots.release()  # first: an await below may be cancelled
                if connection.is_idle():
                    self._idle.append(connection)
                else:
                    await connection.aclose()

    async def warm(self) -> None:
        """Load anyio's asyncio backend now: lazily it costs ~20 ms inside the first request."""
        await anyio.sleep(0)

    async def aclose(self) -> None:
        for connection in self._idle:
            await connection.aclose()
        self._idle.clear()
