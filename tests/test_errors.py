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


def test_the_proxy_running_out_is_503_overloaded_never_the_upstreams_fault():
    import errno

    from proxy.errors import ProxyOverloaded

    for number, reason in ((errno.EMFILE, "descriptors"), (errno.ENFILE, "descriptors"), (errno.EADDRNOTAVAIL, "ports"),
                           (errno.ENOBUFS, "memory"), (errno.ENOMEM, "memory")):
        error = map_transport_error(caused(transport.ConnectError("x"), OSError(number, "exhausted")), "u")
        assert isinstance(error, ProxyOverloaded) and error.reason == reason, number
        assert error.status == 503 and error.outcome == "overloaded" and error.code == "proxy_overloaded"
        assert "the proxy is overloaded" in orjson.loads(error.body())["error"]["message"]
        headers = dict(error.headers())
        assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert map_transport_error(caused(transport.ConnectError("x"), MemoryError()), "u").reason == "memory"
    shed = ProxyOverloaded("max_in_flight", "full")
    assert b"connection" not in dict(shed.headers())  # shedding keeps the client's connection
    refused = map_transport_error(caused(transport.ConnectError("x"), ConnectionRefusedError(111, "refused")), "u")
    assert refused.code == "upstream_connect_error"  # a real refusal is still the upstream's
