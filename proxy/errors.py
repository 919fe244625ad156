"""A small exception tree and the one table that maps transport failures onto it.

Every failure the proxy itself reports becomes an OpenAI-style body
`{"error": {"message", "type", "code", "param"}}` with a status that names the class of cause:
502 when the upstream could not be reached or spoke garbage, 504 when it was too slow, 503 when
the proxy itself is out of room (admission control, its upstream pool full, or out of descriptors,
ephemeral ports or memory): that one is the proxy's, so it must never read as the upstream's fault.
Upstream HTTP errors (4xx/5xx, 429) are not ours: they pass through unchanged.
"""
from __future__ import annotations

import errno
import socket
import ssl

from typing import Literal

import orjson

# What a request came to: ok, or the class of its failure (each error below names its own).
Outcome = Literal["ok", "upstream_error", "client_disconnect", "client_slow", "timeout", "proxy_error", "overloaded"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "upstream_error", "client_disconnect", "client_slow", "timeout", "proxy_error", "overloaded")


class ProxyError(Exception):
    status = 500
    type = "proxy_error"
    code = "proxy_error"
    outcome: Outcome = "proxy_error"

    def body(self) -> bytes:
        return error_body(str(self) or self.code, self.type, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers (Retry-After for load shedding)."""
        return []


class UpstreamError(ProxyError):
    status = 502
    type = "upstream_error"
    code = "upstream_unavailable"
    outcome = "upstream_error"


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamDNSError(UpstreamError):
    code = "upstream_dns_error"


class UpstreamTLSError(UpstreamError):
    code = "upstream_tls_error"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class UpstreamProxyError(UpstreamError):
    """The egress proxy (egress.py) could not be reached, or refused the tunnel or the request."""

    code = "upstream_proxy_error"


class UpstreamTimeout(ProxyError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"
    outcome = "timeout"


class BodyTooLarge(ProxyError):
    status, type, code, outcome = 413, "invalid_request_error", "request_too_large", "proxy_error"


class BodyTimeout(ProxyError):
    status, type, code, outcome = 408, "invalid_request_error", "request_timeout", "proxy_error"


class Unauthorized(ProxyError):
    status, type, code, outcome = 401, "invalid_request_error", "invalid_api_key", "proxy_error"


class BadPath(ProxyError):
    status, type, code, outcome = 400, "invalid_request_error", "invalid_path", "proxy_error"


class ModelNotRouted(ProxyError):
    status, type, code, outcome = 404, "invalid_request_error", "model_not_found", "proxy_error"


class ProxyOverloaded(ProxyError):
    """The proxy has no room for this request: `reason` is max_in_flight (admission control: its
    tenant at or over its share at the cap), queue_timeout (it waited --admission-queue-s), pool
    (every connection of the upstream's pool in use, --max-connections), descriptors, ports or
    memory (exhausted while accepting or connecting)."""

    status, type, code, outcome = 503, "proxy_error", "proxy_overloaded", "overloaded"
    retry_after_s = 1

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"the proxy is overloaded ({detail}); retry after {self.retry_after_s} s")
        self.reason = reason

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"retry-after", str(self.retry_after_s).encode())]
        if self.reason not in ("max_in_flight", "queue_timeout", "pool"):  # out of descriptors, ports or memory: free this client's too
            out.append((b"connection", b"close"))
        return out


# errno of a failed socket call that means the proxy's own machine is out of something.
EXHAUSTED: dict[int, tuple[str, str]] = {
    errno.EMFILE: ("descriptors", "no file descriptor left in the proxy process (RLIMIT_NOFILE)"),
    errno.ENFILE: ("descriptors", "no file descriptor left on the machine (fs.file-max)"),
    errno.EADDRNOTAVAIL: ("ports", "no local ephemeral port left to connect from"),
    errno.ENOBUFS: ("memory", "no kernel buffer space left for a socket"),
    errno.ENOMEM: ("memory", "out of memory"),
}


def exhaustion(exc: BaseException) -> ProxyOverloaded | None:
    """The ProxyOverloaded for a failure that was the proxy's own machine running out, else None."""
    for cause in _root_causes(exc):
        if isinstance(cause, MemoryError):
            return ProxyOverloaded("memory", "out of memory")
        if isinstance(cause, OSError) and cause.errno in EXHAUSTED:
            reason, detail = EXHAUSTED[cause.errno]
            return ProxyOverloaded(reason, detail)
    return None


class TransportError(Exception):
    """A failure talking to the upstream, raised by the upstream client; mapped below."""


class ConnectError(TransportError):
    pass


class EgressError(ConnectError):
    """Through the egress proxy: it is unreachable, or it refused (a 407, a 403, its own 502)."""


class ConnectTimeout(TransportError):
    pass


class WriteTimeout(TransportError):
    pass


class RemoteProtocolError(TransportError):
    pass


class ReadError(TransportError):
    pass


class WriteError(TransportError):
    pass


def error_body(message: str, type_: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code, "param": None}})


def _root_causes(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


# (transport exception, our class, message prefix): the first matching row wins. Waiting for the
# response (headers or body) is bounded by the relay's first-token and read limits, not here.
TRANSPORT_ERRORS: tuple[tuple[type[BaseException], type[ProxyError], str], ...] = (
    (ConnectTimeout, UpstreamTimeout, "timed out connecting to the upstream"),
    (WriteTimeout, UpstreamTimeout, "timed out sending the request upstream"),
    (EgressError, UpstreamProxyError, "could not reach the upstream through the egress proxy"),
    (ConnectError, UpstreamConnectError, "could not connect to the upstream"),
    (RemoteProtocolError, UpstreamProtocolError, "the upstream broke the HTTP protocol"),
    (ReadError, UpstreamProtocolError, "the upstream connection failed while reading"),
    (WriteError, UpstreamConnectError, "the upstream connection failed while sending"),
    (OSError, UpstreamConnectError, "could not reach the upstream"),
)


def map_transport_error(exc: BaseException, upstream: str) -> ProxyError:
    """Translate a transport exception into the proxy's tree, naming the cause."""
    if isinstance(exc, ProxyError):
        return exc
    overloaded = exhaustion(exc)  # never blamed on the upstream
    if overloaded is not None:
        return overloaded
    causes = _root_causes(exc)
    detail = str(exc) or type(exc).__name__
    if any(isinstance(c, socket.gaierror) for c in causes):
        return UpstreamDNSError(f"could not resolve the upstream host of {upstream}: {detail}")
    if any(isinstance(c, ssl.SSLError) for c in causes):
        return UpstreamTLSError(f"TLS handshake with the upstream {upstream} failed: {detail}")
    for exc_type, ours, message in TRANSPORT_ERRORS:
        if isinstance(exc, exc_type):
            return ours(f"{message} ({upstream}): {detail}")
    return ProxyError(f"internal proxy error: {type(exc).__name__}")
