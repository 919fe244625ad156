"""The fault matrix: each fault injected for real (sockets, processes), each with a clear error or a
faithful passthrough, the right outcome in the record, no hang and nothing left open."""
from __future__ import annotations

import datetime
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from proxy.processes import free_port
from servers import Process

pytestmark = pytest.mark.e2e


def chat(n: int = 5, stream: bool = True, **extra) -> dict:
    return {"model": "sim-7b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": n, "stream": stream, **extra}


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost/127.0.0.1 and its key, made here (no CA involved)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_sim(tmp_path_factory):
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    port = free_port()
    proc = Process(["simulate", "--port", str(port), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)], f"https://127.0.0.1:{port}/health", verify=str(cert))
    yield port, cert
    proc.stop()


def test_tls_untrusted_is_502_and_a_ca_bundle_fixes_it(proxy_factory, tls_sim):
    port, cert = tls_sim
    untrusted = proxy_factory(upstream=f"https://localhost:{port}/v1")
    response = httpx.post(f"{untrusted.v1}/chat/completions", json=chat())
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_tls_error"
    assert untrusted.last_record()["outcome"] == "upstream_error"
    trusted = proxy_factory(upstream=f"https://localhost:{port}/v1", ca_bundle=str(cert))
    chunks = list(openai.OpenAI(base_url=trusted.v1, api_key="k", max_retries=0).chat.completions.create(
        model="sim-7b", messages=[{"role": "user", "content": "x"}], max_tokens=3, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 3
    record = trusted.last_record()
    assert {"dns", "tcp", "tls"} <= set(record["connect_s"]) and record["connect_s"]["tls"] > 0


def test_connect_timeout_is_504(proxy_factory):
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)  # never accepts: once its one-slot queue is full, SYNs go unanswered
    filler = socket.create_connection(blackhole.getsockname())
    try:
        server = proxy_factory(upstream=f"http://127.0.0.1:{blackhole.getsockname()[1]}/v1", connect_timeout=0.5)
        start = time.monotonic()
        response = httpx.post(f"{server.v1}/chat/completions", json=chat(), timeout=10)
        assert response.status_code == 504 and response.json()["error"]["code"] == "upstream_timeout"
        assert "connecting" in response.json()["error"]["message"]
        assert 0.4 < time.monotonic() - start < 3
        assert server.last_record()["outcome"] == "timeout"
    finally:
        filler.close()
        blackhole.close()


def test_a_long_prefill_is_not_killed_by_the_inter_token_timeout(proxy_factory):
    server = proxy_factory(read_timeout=0.3, first_token_timeout=5)
    response = httpx.post(f"{server.v1}/chat/completions", json=chat(3), headers={"x-sim-ttft-ms": "1200"}, timeout=10)
    assert response.status_code == 200 and response.text.count('"content":" ') == 3
    record = server.last_record()
    assert record["outcome"] == "ok" and record["ttft_s"] > 1.1


def test_an_upstream_that_stalls_mid_stream_is_cut_by_the_inter_token_timeout(proxy_factory, sim):
    server = proxy_factory(read_timeout=0.4)
    before = sim.stats()["disconnects"]
    start = time.monotonic()
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{server.v1}/chat/completions", json=chat(20), headers={"x-sim-stall-after": "3"}, timeout=10) as r:
            for _ in r.iter_raw():
                pass
    assert time.monotonic() - start < 3
    record = server.last_record()
    assert record["outcome"] == "timeout" and record["error"] == "mid_stream:upstream_timeout" and record["content_chunks"] == 3
    deadline = time.monotonic() + 2
    while sim.stats()["disconnects"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sim.stats()["disconnects"] == before + 1  # the stalled upstream request was closed too


def test_malformed_sse_is_relayed_unchanged_and_counted(sim, proxy):
    body = chat(4, stream_options={"include_usage": True})
    headers = {"x-sim-malformed": "1"}
    direct = httpx.post(f"{sim.url}/v1/chat/completions", json=body, headers=headers).content
    via = httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=headers).content
    assert via == direct and b"unterminated" in via
    record = proxy.last_record()
    assert record["malformed_chunks"] == 1 and record["outcome"] == "ok"


def kernel_buffer_bytes() -> int:
    """The most the kernel may buffer between the simulator and a client that reads nothing: each TCP
    socket's autotuned send and receive buffers at their maxima (the simulator's and the proxy's
    sending sides, the proxy's upstream receiving side; the client's is set to 64 KiB below)."""
    wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    return 2 * wmem + rmem + 2 * 65536


def test_a_slow_reader_gets_backpressure_not_unbounded_buffering(sim, proxy):
    """The client stops reading: the proxy stops reading upstream too once its read-ahead is full, so
    the simulator blocks, with no more in between than the read-ahead and the kernel's buffers."""
    before = sim.stats()["tokens_sent"]
    token_bytes = 10000
    bound = proxy.settings.stream_buffer_bytes + 256 * 1024 + kernel_buffer_bytes()  # (read-ahead: exceeded by one socket read)
    total = 2 * bound // token_bytes  # twice what could be in between: the simulator must block half-way at the latest
    payload = httpx.Request("POST", f"{proxy.v1}/chat/completions", json=chat(total),
                            headers={"x-sim-token-bytes": str(token_bytes), "x-sim-decode-tps": "100000", "x-sim-ttft-ms": "0"})
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        head = "".join(f"{k}: {v}\r\n" for k, v in payload.headers.items())
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode() + payload.read())
        time.sleep(1.5)  # read nothing
        stalled = sim.stats()["tokens_sent"] - before
        read_ahead = proxy.app.router.budget.used
        time.sleep(0.5)
        assert sim.stats()["tokens_sent"] - before == stalled, "the simulator kept sending while the client read nothing"
        assert stalled * token_bytes <= bound, f"the simulator sent {stalled} tokens while the client read nothing"
        assert 0 < read_ahead <= proxy.settings.stream_buffer_bytes + 256 * 1024
        received = 0
        sock.settimeout(10)
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
            if chunk.endswith(b"0\r\n\r\n"):
                break
    assert sim.stats()["tokens_sent"] - before == total
    assert received > total * token_bytes
    assert proxy.last_record()["outcome"] == "ok"


@pytest.mark.parametrize("body", [
    b'{"model": 5, "messages": "not a list", "stream": "yes"}',
    b'{"model": "m", "messages": [{"role": "user", "content": {"nested": true}}], "max_tokens": "ten"}',
    b"\xff\xfe\x00 not utf-8 at all \x80",
    b"[1, 2, 3]",
    b'{"model": "m", "stream": true, "stream_options": "weird", "messages": []}',
])
def test_bad_input_is_forwarded_unchanged(sim, proxy, body):
    headers = {"content-type": "application/json"}
    direct = httpx.post(f"{sim.url}/v1/chat/completions", content=body, headers=headers, timeout=10)
    via = httpx.post(f"{proxy.v1}/chat/completions", content=body, headers=headers, timeout=10)
    assert via.status_code == direct.status_code and via.content == direct.content


def test_a_huge_body_is_413(proxy_factory):
    server = proxy_factory(max_body_bytes=10_000)
    response = httpx.post(f"{server.v1}/chat/completions", content=b"x" * 20_000, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no content-length: the limit still holds while reading
        for _ in range(10):
            yield b"y" * 2_000

    response = httpx.post(f"{server.v1}/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_slowloris_headers_and_bodies_are_cut(proxy_factory):
    from proxy.serve.server import GuardedHttpTools

    server = proxy_factory()
    # The in-process test server uses uvicorn's stock protocol: run the guarded one on its own port.
    import threading

    import uvicorn

    port = free_port()
    GuardedHttpTools.header_timeout = 0.5
    config = uvicorn.Config(server.app, host="127.0.0.1", port=port, http=GuardedHttpTools, loop="asyncio", log_level="error", lifespan="off")
    guarded = uvicorn.Server(config)
    threading.Thread(target=guarded.run, daemon=True).start()
    while not guarded.started:
        time.sleep(0.02)
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # ... and never finish the headers
            sock.settimeout(5)
            start = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the proxy
            assert time.monotonic() - start < 2
        with socket.create_connection(("127.0.0.1", port)) as sock:  # a keep-alive connection's second request, trickled
            sock.settimeout(5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")  # (whole: no deadline armed for it)
            reply = sock.recv(4096)
            head, _, body = reply.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200")
            time.sleep(0.7)  # (past the header timeout: an idle keep-alive connection is uvicorn's to time out, not this guard's)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            start = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the proxy, the header timeout after this request began
            assert 0.4 < time.monotonic() - start < 2
    finally:
        guarded.should_exit = True
        GuardedHttpTools.header_timeout = 10.0
    slow_body = proxy_factory(body_timeout=0.5)
    with socket.create_connection(("127.0.0.1", slow_body.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        sock.settimeout(5)
        reply = sock.recv(4096)
        while b"request_timeout" not in reply and (part := sock.recv(4096)):
            reply += part
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply


def test_header_injection_attempts_do_not_reach_the_upstream(sim, proxy):
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        body = b'{"model":"m","messages":[]}'
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-test: a\rx-injected: yes\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.settimeout(5)
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400")  # the HTTP parser refuses a bare CR in a header
    evil_model = "m\r\nx-injected: yes"
    response = httpx.post(f"{proxy.v1}/chat/completions", json={"model": evil_model, "messages": [], "max_tokens": 1})
    assert response.status_code == 200 and "x-injected" not in sim.stats()["last_headers"]
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(httpx.get(f"{proxy.url}/metrics").text))  # still parses
    models = {s.labels.get("model") for f in families for s in f.samples}
    assert "m\ufffd\ufffdx-injected: yes" in models and evil_model not in models  # measured under its controls replaced (text.py)


def test_no_open_proxy(sim, proxy):
    """The upstream is fixed by configuration: no URL, Host header or path makes the proxy call elsewhere."""
    before = sim.stats()["requests"]
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"GET http://169.254.169.254/v1/models HTTP/1.1\r\nhost: 169.254.169.254\r\nconnection: close\r\n\r\n")
        sock.settimeout(5)
        reply = b""
        while part := sock.recv(4096):
            reply += part
    assert reply.startswith(b"HTTP/1.1 200") and b"sim-7b" in reply  # answered by the configured upstream
    response = httpx.get(f"{proxy.v1}/../../etc/passwd")
    assert response.status_code in (400, 404)
    raw = httpx.get(f"{proxy.url}/v1/models/%2e%2e/%2e%2e/admin")
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_path"
    assert sim.stats()["requests"] == before  # /v1/models is not counted by the simulator; nothing else went out
    assert reply.lower().count(b"\r\ndate:") == 1  # the upstream's Date, not a second one of the proxy's


def test_an_endless_event_is_relayed_unframed_and_stalls_no_other_stream(proxy_factory, sim):
    """One SSE data line that never ends (256 KB more every 10 ms) beside a steady 20 ms stream: the
    endless one reaches its client as it comes and is counted unmeasured (event_too_large) once past
    --max-event-bytes; the steady one keeps its schedule (before: gaps up to 350 ms, memory unbounded)."""
    import threading

    proxy = proxy_factory(max_event_bytes=2 * 1024 * 1024)
    received = [0]

    def endless() -> None:
        headers = {"x-sim-endless-event-bytes": str(256 * 1024), "x-sim-endless-every-ms": "10"}
        body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers=headers, timeout=30) as response:
            for part in response.iter_raw():
                received[0] += len(part)
                if received[0] > 12 * 1024 * 1024:
                    return

    thread = threading.Thread(target=endless)
    thread.start()
    client = openai.OpenAI(base_url=proxy.v1, api_key="k", max_retries=0)
    arrivals = []
    for chunk in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=40, stream=True,
                                                extra_headers={"x-sim-ttft-ms": "20", "x-sim-decode-tps": "50"}):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    thread.join(timeout=30)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) == 40 and max(gaps) < 0.100, max(gaps)  # a 20 ms schedule; generous for a busy 2-core machine
    assert received[0] > 12 * 1024 * 1024  # the endless event's bytes reached its client
    records = proxy.wait_records(2)
    endless_record = next(r for r in records if r["unmeasured"])
    assert endless_record["unmeasured"] == "event_too_large" and endless_record["content_chunks"] == 0
    assert proxy.sample("llmproxy_unmeasured_requests_total", {"upstream": proxy.settings.upstream_label, "reason": "event_too_large"}) == 1
