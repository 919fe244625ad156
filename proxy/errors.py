"""A small exception tree and the one table that maps transport failures onto it.

Every failure the proxy itself reports becomes an OpenAI-style body
`{"error": {"message", "type", "code", "param"}}` with a status that names the class of cause:
502 when the upstream could not be reached or spoke garbage, 504 when it was too slow.
Upstream HTTP errors (4xx/5xx, 429) are not ours: they pass through unchanged.
"""
from __future__ import annotations

import socket
import ssl

import orjson

from .timing import Outcome


class ProxyError(Exception):
    status = 500
    type = "proxy_error"
    code = "proxy_error"
    outcome: Outcome = "proxy_error"

    def body(self) -> bytes:
        return error_body(str(self) or self.code, self.type, self.code)


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


class TransportError(Exception):
    """A failure talking to the upstream, raised by the upstream client; mapped below."""


class ConnectError(TransportError):
    pass


class ConnectTimeout(TransportError):
    pass


class PoolTimeout(TransportError):
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
    (PoolTimeout, UpstreamTimeout, "timed out waiting for a free upstream connection"),
    (WriteTimeout, UpstreamTimeout, "timed out sending the request upstream"),
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
