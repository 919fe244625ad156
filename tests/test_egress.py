"""Egress proxies: which one (curl's variables), and the upstream reached through a real forward
proxy (Debian's tinyproxy, Basic authentication) on loopback: a CONNECT tunnel with TLS end to end
to an https upstream, the certificate checked against the upstream's name, absolute-form requests
to an http one, the CONNECT timed as its own step, NO_PROXY obeyed, no credential anywhere."""
from __future__ import annotations

import datetime
from pathlib import Path

import httpx
import openai
import pytest

from proxy.config import parse_egress
from proxy.upstream import egress
from proxy.processes import free_port

from servers import Process, TinyProxy


def test_which_proxy_as_curl_reads_the_variables():
    env = {"https_proxy": "http://lower:3128", "HTTPS_PROXY": "http://upper:3128", "HTTP_PROXY": "http://httpoxy:3128"}
    assert egress.choose("https", "api.openai.com", 443, environ=env).host == "lower"  # lower case first
    assert egress.choose("https", "api.openai.com", 443, environ={"HTTPS_PROXY": "http://upper:3128"}).host == "upper"
    assert egress.choose("http", "vllm", 8000, environ=env) is None  # HTTP_PROXY is never read (httpoxy)
    assert egress.choose("http", "vllm", 8000, environ={"http_proxy": "proxy:8080"}).port == 8080  # a bare host:port is http
    assert egress.choose("http", "vllm", 8000, environ={"ALL_PROXY": "http://all:1"}).host == "all"
    assert egress.choose("https", "a", 443, explicit="http://explicit:9", environ={**env, "NO_PROXY": "*"}).host == "explicit"
    assert egress.choose("https", "a", 443, explicit="none", environ=env) is None
    with_creds = egress.choose("https", "a", 443, environ={"https_proxy": "http://us%40er:p%3Ass@p:1"})
    assert with_creds.authorization == b"Basic " + __import__("base64").b64encode(b"us@er:p:ss") and "p:ss" not in with_creds.where
    with pytest.raises(ValueError, match="http:// URL") as refused:
        parse_egress("https://user:TOPSECRET@proxy:443")
    assert "TOPSECRET" not in str(refused.value)


@pytest.mark.parametrize("host, port, no_proxy, expected", [
    ("api.openai.com", 443, "*", True),
    ("api.openai.com", 443, "openai.com", True),  # a domain covers its subdomains
    ("api.openai.com", 443, ".openai.com", True),
    ("notopenai.com", 443, "openai.com", False),
    ("vllm.internal", 8000, "localhost, vllm.internal", True),
    ("10.1.2.3", 8000, "10.0.0.0/8", True),
    ("10.1.2.3", 8000, "10.1.2.3", True),
    ("11.1.2.3", 8000, "10.0.0.0/8", False),
    ("vllm", 8000, "vllm:9000", False),  # with a port, only that port
    ("vllm", 9000, "vllm:9000", True),
    ("::1", 8000, "::1", True),
])
def test_no_proxy_as_curl_matches_it(host, port, no_proxy, expected):
    assert egress.bypassed(host, port, no_proxy) is expected


def certificate(directory: Path, names: list[str]) -> tuple[Path, Path]:
    """A self-signed certificate for these DNS names only (no IP address)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path




@pytest.fixture(scope="module")
def forward(tmp_path_factory: pytest.TempPathFactory):
    proxy = TinyProxy(tmp_path_factory.mktemp("tinyproxy"))
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def tls_upstream(tmp_path_factory: pytest.TempPathFactory):
    cert, key = certificate(tmp_path_factory.mktemp("tls"), ["localhost"])
    port = free_port()
    sim = Process(["simulate", "--port", str(port), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)], f"https://localhost:{port}/health",
                  verify=str(cert))
    yield port, cert
    sim.stop()


def serve(upstream: str, env: dict[str, str], tmp_path: Path, *flags: str) -> tuple[Process, str]:
    port = free_port()
    process = Process(["serve", "--upstream", upstream, "--port", str(port), "--log-level", "debug", *flags], f"http://127.0.0.1:{port}/healthz",
                      env, log=tmp_path / "proxy.log")
    return process, f"http://127.0.0.1:{port}"


def stream(base: str) -> int:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-egress-test", max_retries=0)
    return sum(1 for c in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                                        stream=True, extra_headers={"x-sim-ttft-ms": "30"}) if c.choices and c.choices[0].delta.content)


@pytest.mark.e2e
@pytest.mark.slow
def test_an_https_upstream_through_a_connect_tunnel_tls_end_to_end(forward, tls_upstream, tmp_path):
    port, cert = tls_upstream
    env = {"HTTPS_PROXY": forward.url(), "NO_PROXY": ""}
    seen = len(forward.requests())
    proxy, base = serve(f"https://localhost:{port}/v1", env, tmp_path, "--ca-bundle", str(cert))
    try:
        assert stream(base) == 5
        record = httpx.get(f"{base}/llmproxy/requests", params={"limit": 1}).json()[-1]
    finally:
        proxy.stop()
    asked = forward.requests()[seen:]
    assert asked == [f"CONNECT localhost:{port} HTTP/1.1"]  # one tunnel; what went through it, the proxy never saw
    # No DNS step: the proxy is an IP address here, and the upstream's name is the proxy's to resolve.
    assert record["outcome"] == "ok" and set(record["connect_s"]) == {"tcp", "proxy", "tls"}
    assert record["connect_s"]["proxy"] > 0 and record["connect_s"]["tls"] > 0  # the CONNECT exchange: its own step
    assert record["phases_s"]["network"] >= sum(record["connect_s"].values()) - 1e-9
    log = (tmp_path / "proxy.log").read_text()
    assert forward.password not in log and forward.password not in str(record)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_certificate_is_checked_against_the_upstreams_name_through_the_tunnel(forward, tls_upstream, tmp_path):
    port, cert = tls_upstream  # a certificate for localhost only: 127.0.0.1 is not its name
    proxy, base = serve(f"https://127.0.0.1:{port}/v1", {"HTTPS_PROXY": forward.url()}, tmp_path, "--ca-bundle", str(cert))
    try:
        response = httpx.post(f"{base}/v1/chat/completions", json={"model": "sim-7b", "messages": [], "max_tokens": 1}, timeout=30)
    finally:
        proxy.stop()
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_tls_error", response.text
    assert f"CONNECT 127.0.0.1:{port} HTTP/1.1" in forward.requests()  # the tunnel was made: TLS inside it refused the name


@pytest.mark.e2e
@pytest.mark.slow
def test_an_http_upstream_through_the_proxy_in_absolute_form_and_no_proxy_obeyed(forward, sim, tmp_path):
    seen = len(forward.requests())
    proxy, base = serve(f"{sim.url}/v1", {"http_proxy": forward.url()}, tmp_path)
    try:
        assert stream(base) == 5
        record = httpx.get(f"{base}/llmproxy/requests", params={"limit": 1}).json()[-1]
    finally:
        proxy.stop()
    assert forward.requests()[seen:] == [f"POST {sim.url}/v1/chat/completions HTTP/1.1"]
    assert record["outcome"] == "ok" and "proxy" not in record["connect_s"]  # no tunnel for http
    seen = len(forward.requests())
    direct, base = serve(f"{sim.url}/v1", {"http_proxy": forward.url(), "NO_PROXY": "example.com, 127.0.0.1"}, tmp_path)
    try:
        assert stream(base) == 5
    finally:
        direct.stop()
    assert forward.requests()[seen:] == []  # bypassed


@pytest.mark.e2e
@pytest.mark.slow
def test_a_proxy_refusing_the_credentials_is_a_clear_502_naming_no_secret(forward, tls_upstream, tmp_path):
    port, cert = tls_upstream
    wrong = forward.url().replace(forward.password, "wrong-PASSWORD-77")
    proxy, base = serve(f"https://localhost:{port}/v1", {}, tmp_path, "--upstream-proxy", wrong, "--ca-bundle", str(cert))
    try:
        response = httpx.post(f"{base}/v1/chat/completions", json={"model": "sim-7b", "messages": [], "max_tokens": 1}, timeout=30)
        metrics = httpx.get(f"{base}/metrics").text
    finally:
        proxy.stop()
    body = response.json()["error"]  # (tinyproxy answers a CONNECT with bad credentials 401, others 407)
    assert response.status_code == 502 and body["code"] == "upstream_proxy_error" and "answered 401 to CONNECT" in body["message"], body
    log = (tmp_path / "proxy.log").read_text()
    for text in (response.text, log, metrics):
        assert "wrong-PASSWORD-77" not in text and "proxyuser" not in text
    down, base = serve(f"https://localhost:{port}/v1", {"HTTPS_PROXY": f"http://127.0.0.1:{free_port()}"}, tmp_path)
    try:  # the proxy itself unreachable: named as the proxy, not as the upstream
        response = httpx.post(f"{base}/v1/chat/completions", json={"model": "sim-7b", "messages": [], "max_tokens": 1}, timeout=30)
    finally:
        down.stop()
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_proxy_error"
    assert "egress proxy 127.0.0.1:" in response.json()["error"]["message"]


def test_a_route_names_its_own_proxy_or_none(tmp_path, monkeypatch):
    from proxy.config import Settings
    from proxy.fleet.routes import Router

    monkeypatch.setenv("HTTPS_PROXY", "http://company-proxy:3128")
    routes = tmp_path / "routes.yaml"
    routes.write_text("upstreams:\n"
                      "  - {name: openai, url: 'https://api.openai.com/v1'}\n"
                      "  - {name: other, url: 'https://other.example/v1', upstream_proxy: 'http://u:p@other-proxy:8080'}\n"
                      "  - {name: inside, url: 'https://vllm.internal/v1', upstream_proxy: none}\n"
                      "routes:\n  - {models: ['*'], upstreams: [openai]}\n")
    router = Router(Settings(routes=str(routes)))
    egresses = {name: upstream.pool.egress for name, upstream in router.upstreams.items()}
    assert egresses["openai"].host == "company-proxy"  # the environment's
    assert egresses["other"].where == "other-proxy:8080" and egresses["other"].authorization  # its own
    assert egresses["inside"] is None  # direct
