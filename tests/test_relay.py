"""End to end: the official openai client through the proxy (real uvicorn) to the simulator."""
from __future__ import annotations

import gc
import socket
import time

import httpx
import openai
import orjson
import pytest

from servers import ProxyServer
from proxy.processes import free_port

pytestmark = pytest.mark.e2e
KEY = "sk-client-abc123-do-not-log"


def client(server: ProxyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0)


def chat_body(n: int = 5, stream: bool = True, **extra) -> dict:
    return {"model": "sim-7b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": n, "stream": stream, **extra}


def raw_stream(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes, list[float]]:
    """Status, headers, body bytes and the arrival time of each read."""
    arrivals, parts = [], []
    with httpx.stream("POST", url, json=body, headers={"authorization": f"Bearer {KEY}", **(headers or {})}, timeout=30) as r:
        for part in r.iter_raw():
            arrivals.append(time.monotonic())
            parts.append(part)
        return r.status_code, dict(r.headers), b"".join(parts), arrivals


def test_chat_stream_and_non_stream(proxy):
    c = client(proxy)
    chunks = list(c.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == " the of and to in is"
    assert all(ch.usage is None for ch in chunks)  # the client did not ask for usage
    reply = c.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.choices[0].message.content == " the of and"
    assert reply.usage.completion_tokens == 3


def test_completions_stream_and_non_stream(proxy):
    c = client(proxy)
    text = "".join(ch.choices[0].text for ch in c.completions.create(model="sim-7b", prompt="hi", max_tokens=4, stream=True) if ch.choices)
    assert text == " the of and to"
    assert c.completions.create(model="sim-7b", prompt="hi", max_tokens=2).choices[0].text == " the of"
    record = proxy.last_record()
    assert record["endpoint"] == "completions" and record["stream"] is False and record["completion_tokens"] == 2


def test_embeddings_models_and_other_paths(proxy):
    c = client(proxy)
    assert len(c.embeddings.create(model="emb", input=["a", "b"]).data) == 2
    assert c.models.list().data[0].id == "sim-7b"
    missing = httpx.get(f"{proxy.v1}/no/such/route")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path,body", [
    ("/chat/completions", chat_body(8)),
    ("/completions", {"model": "sim-7b", "prompt": "x", "max_tokens": 8, "stream": True}),
    ("/chat/completions", chat_body(8, stream=False)),
    ("/chat/completions", chat_body(8, stream_options={"include_usage": True})),
])
def test_bytes_equal_direct_and_via_proxy(sim, proxy, path, body):
    direct = raw_stream(f"{sim.url}/v1{path}", body)
    via = raw_stream(f"{proxy.v1}{path}", body)
    assert via[0] == direct[0] == 200
    assert via[2] == direct[2]
    assert via[1]["content-type"] == direct[1]["content-type"]


def test_chunks_are_relayed_as_they_arrive(sim, proxy):
    # 10 tokens 30 ms apart: the client must see them spread out, not coalesced at the end.
    _, headers, body, arrivals = raw_stream(f"{proxy.v1}/chat/completions", chat_body(10), {"x-sim-decode-tps": "33.33", "x-sim-ttft-ms": "50"})
    assert headers["x-accel-buffering"] == "no"
    assert body.count(b'"content":" ') == 10
    assert len(arrivals) >= 10
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(1 for g in gaps if g > 0.020) >= 8


def test_usage_is_injected_upstream_and_stripped_for_the_client(sim, proxy):
    _, _, body, _ = raw_stream(f"{proxy.v1}/chat/completions", chat_body(7))
    assert sim.stats()["last_body"]["stream_options"] == {"include_usage": True}
    assert b'"usage"' not in body
    record = proxy.last_record()
    assert record["token_source"] == "usage" and record["completion_tokens"] == 7 and record["prompt_tokens"] > 0


def test_client_requested_usage_passes_through(sim, proxy):
    _, _, body, _ = raw_stream(f"{proxy.v1}/chat/completions", chat_body(3, stream_options={"include_usage": True}))
    assert b'"usage":{"prompt_tokens"' in body and body.count(b'"usage":null') >= 3


def test_without_injection_tokens_are_counted_by_the_tokenizer(sim, proxy_factory):
    server = proxy_factory(inject_usage=False)
    _, _, body, _ = raw_stream(f"{server.v1}/chat/completions", chat_body(9))
    assert "stream_options" not in sim.stats()["last_body"]
    record = server.last_record()
    assert record["token_source"] == "tokenizer" and record["completion_tokens"] == 9


def test_upstream_errors_pass_through_unchanged(sim, proxy):
    headers = {"x-sim-error-status": "429", "x-sim-retry-after": "7"}
    direct = httpx.post(f"{sim.url}/v1/chat/completions", json=chat_body(), headers=headers)
    via = httpx.post(f"{proxy.v1}/chat/completions", json=chat_body(), headers=headers)
    assert via.status_code == 429 and via.headers["retry-after"] == "7" and via.content == direct.content
    with pytest.raises(openai.RateLimitError):
        client(proxy).chat.completions.create(model="sim-7b", messages=[], extra_headers=headers)
    with pytest.raises(openai.InternalServerError):
        client(proxy).chat.completions.create(model="sim-7b", messages=[], extra_headers={"x-sim-error-status": "503"})
    record = proxy.last_record()
    assert record["outcome"] == "upstream_error" and record["status_code"] == 503


def test_unreachable_upstream_is_502_with_openai_error(proxy_factory):
    server = proxy_factory(upstream=f"http://127.0.0.1:{free_port()}/v1")
    response = httpx.post(f"{server.v1}/chat/completions", json=chat_body())
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_connect_error"
    with pytest.raises(openai.InternalServerError):
        client(server).chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "x"}])
    labels = {"model": "sim-7b", "upstream": server.settings.upstream_label, "endpoint": "chat", "stream": "true",
              "outcome": "upstream_error", "code": "502"}
    assert server.sample("llmproxy_requests_total", labels) == 1


def test_dns_failure_is_502_naming_dns(proxy_factory):
    server = proxy_factory(upstream="http://llm-upstream.test:8000/v1")

    async def no_such_host(host, port, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    server.app.upstream.pool.resolver = no_such_host
    response = httpx.post(f"{server.v1}/chat/completions", json=chat_body())
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_dns_error"


def test_first_token_timeout_is_504(proxy_factory):
    server = proxy_factory(first_token_timeout=0.3)
    response = httpx.post(f"{server.v1}/chat/completions", json=chat_body(stream=False), headers={"x-sim-ttft-ms": "1500"})
    assert response.status_code == 504 and response.json()["error"]["code"] == "upstream_timeout"
    assert server.last_record()["outcome"] == "timeout"


def test_upstream_dropping_mid_stream_breaks_the_client_stream(proxy):
    received = []
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        stream = client(proxy).chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                                       stream=True, extra_headers={"x-sim-drop-after": "5"})
        for chunk in stream:
            received.append(chunk)
    assert sum(1 for c in received if c.choices and c.choices[0].delta.content) == 5
    record = proxy.last_record()
    assert record["outcome"] == "upstream_error" and record["error"].startswith("mid_stream")


@pytest.mark.parametrize("when", ["before_first_token", "mid_stream", "non_streaming", "big_body", "mid_stream_other_server"])
def test_client_disconnect_closes_the_upstream_at_once(sim, proxy_factory, when):
    """The server's protocol tells the relay (server.py's "lost" stamp). `big_body`: a 300 KB body, past which
    uvicorn pauses reading, so a close is seen only because reading resumes once the body is whole.
    `mid_stream_other_server`: under uvicorn's own protocol (no stamps, as under another ASGI server), the relay's
    watcher task waits on the ASGI receive for http.disconnect instead."""
    proxy = proxy_factory(http="httptools") if when == "mid_stream_other_server" else proxy_factory()
    before = sim.stats()["disconnects"]
    mid_stream = when.startswith("mid_stream")
    headers = {"authorization": f"Bearer {KEY}", "x-sim-decode-tps": "50", "x-sim-ttft-ms": "0" if mid_stream else "2000"}
    if when == "non_streaming":  # no response headers until the end: leave from a raw socket
        payload = orjson.dumps(chat_body(200, stream=False))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(payload)}\r\n{head}\r\n".encode() + payload)
            time.sleep(0.3)
    else:
        body = chat_body(200, messages=[{"role": "user", "content": "word " * 60_000}]) if when == "big_body" else chat_body(200)
        with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers=headers, timeout=30) as r:
            if mid_stream:
                seen = 0
                for part in r.iter_raw():
                    seen += part.count(b'"content":" ')
                    if seen >= 3:
                        break
            else:
                time.sleep(0.3)
    closed_at = time.monotonic()
    while sim.stats()["disconnects"] == before and time.monotonic() - closed_at < 2:
        time.sleep(0.01)
    assert sim.stats()["disconnects"] == before + 1
    assert time.monotonic() - closed_at < 1.0
    assert proxy.last_record()["outcome"] == "client_disconnect"


def test_unparseable_body_is_forwarded_unchanged(sim, proxy):
    body = b'{"model": "sim-7b", "messages": [broken'
    direct = httpx.post(f"{sim.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    via = httpx.post(f"{proxy.v1}/chat/completions", content=body, headers={"content-type": "application/json"})
    assert via.status_code == direct.status_code == 400 and via.content == direct.content
    assert proxy.last_record()["model"] == "unknown"


def test_authorization_is_forwarded_or_replaced_and_never_recorded(sim, proxy_factory, monkeypatch):
    plain = proxy_factory()
    raw_stream(f"{plain.v1}/chat/completions", chat_body(2))
    assert sim.stats()["last_headers"]["authorization"] == f"Bearer {KEY}"
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-upstream-xyz")
    from proxy.config import build_settings

    key = build_settings(None, {"LLMPROXY_UPSTREAM_API_KEY_ENV": "TEST_UPSTREAM_KEY", "TEST_UPSTREAM_KEY": "sk-upstream-xyz"}).upstream_api_key
    keyed = proxy_factory(upstream_api_key=key, upstream_api_key_env="TEST_UPSTREAM_KEY")
    raw_stream(f"{keyed.v1}/chat/completions", chat_body(2))
    assert sim.stats()["last_headers"]["authorization"] == "Bearer sk-upstream-xyz"
    for server in (plain, keyed):
        exposed = httpx.get(f"{server.url}/metrics").text + orjson.dumps(server.records()).decode()
        exposed += "".join(str(dict(s.attributes)) for s in server.exporter.get_finished_spans())
        assert KEY not in exposed and "sk-upstream-xyz" not in exposed


def test_telemetry_failures_are_counted_and_never_reach_the_client(proxy, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("exporter exploded")

    monkeypatch.setattr(proxy.app.telemetry.tracing, "_attributes", broken)  # building the spans fails (they still go out)
    monkeypatch.setattr(type(proxy.app.telemetry.tokenizer), "timed_counts", broken)  # the prompt count fails (a compiled class: patched on it)
    c = client(proxy)
    for _ in range(2):
        chunks = list(c.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "x"}], max_tokens=3, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " the of and"
    proxy.wait_records(2)
    assert proxy.sample("llmproxy_telemetry_errors_total", {"component": "tracing"}) == 2
    assert proxy.sample("llmproxy_telemetry_errors_total", {"component": "tokenizer"}) == 2
    assert proxy.last_record()["outcome"] == "ok"


def test_a_finished_request_is_freed_without_the_garbage_collector(proxy):
    """Nothing a request built refers back to itself once it is over (relay.Exchange._let_go): reference
    counting frees it, and the collector, whose young collections are CPU and a pause on every stream,
    has none of it to walk. The collector, off while the requests run, then finds none of the proxy's
    objects unreachable (before: some 40 a request, the exchange, its reply, pump, reader and timing)."""
    c = client(proxy)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            assert list(c.chat.completions.create(**chat_body(8)))
            assert c.chat.completions.create(**chat_body(4, stream=False)).choices
        with pytest.raises(openai.RateLimitError):  # (an upstream's error relayed)
            c.chat.completions.create(**chat_body(4), extra_headers={"x-sim-error-status": "429"})
        deadline = time.monotonic() + 5
        while (proxy.in_flight() or not proxy.app.telemetry.idle) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # (each request's task ends just after its last byte and its finish)
        gc.collect()
        left = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("proxy.")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert proxy.sample("llmproxy_requests_total", {"model": "sim-7b", "upstream": proxy.settings.upstream_label, "endpoint": "chat",
                                                    "stream": "true", "outcome": "ok", "code": "200"}) == 3
    assert not left, f"left for the collector: {left}"
