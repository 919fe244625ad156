"""One table maps transport failures to 502/504 with OpenAI-style bodies."""
import socket
import ssl

import orjson

from proxy import errors as transport

from proxy.errors import UpstreamDNSError, UpstreamTLSError, map_transport_error


def caused(exc, cause):
    try:
        raise exc from cause
    except Exception as e:  # noqa: BLE001
        return e


def test_dns_and_tls_are_named():
    dns = map_transport_error(caused(transport.ConnectError("x"), socket.gaierror(-2, "Name or service not known")), "u")
    assert isinstance(dns, UpstreamDNSError) and dns.status == 502
    tls = map_transport_error(caused(transport.ConnectError("x"), ssl.SSLCertVerificationError("bad cert")), "u")
    assert isinstance(tls, UpstreamTLSError) and tls.status == 502


def test_timeouts_are_504_and_refusals_502():
    assert map_transport_error(transport.ConnectTimeout("t"), "u").status == 504
    assert map_transport_error(transport.PoolTimeout("t"), "u").status == 504
    assert map_transport_error(transport.WriteTimeout("t"), "u").status == 504
    refused = map_transport_error(caused(transport.ConnectError("x"), ConnectionRefusedError(111, "refused")), "u")
    assert refused.status == 502 and refused.code == "upstream_connect_error"


def test_body_is_openai_shaped():
    error = map_transport_error(transport.ConnectTimeout("slow"), "127.0.0.1:9")
    body = orjson.loads(error.body())
    assert set(body["error"]) >= {"message", "type", "code"}
    assert body["error"]["code"] == "upstream_timeout" and "127.0.0.1:9" in body["error"]["message"]


def test_unknown_exceptions_are_proxy_errors_without_detail_leaks():
    error = map_transport_error(RuntimeError("secret internals"), "u")
    assert error.status == 500 and "secret internals" not in error.body().decode()
