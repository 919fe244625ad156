"""The upstream pool, on real sockets in front of the simulator: sized from what the process can hold,
its full state a named 503 or a bounded wait that is the proxy's own phase (`wait`), never network;
its gauges and counters on the scrape."""
from __future__ import annotations

import resource
import threading
import time

import httpx
import openai
import pytest

from servers import raw_upstream, scraped
from proxy.upstream.limits import RESERVE

MSG = [{"role": "user", "content": "hi"}]


def hold(server, seconds: float, started: threading.Event) -> None:
    """One stream that keeps the pool's only connection for about `seconds`."""
    client = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0)
    tokens = int(seconds * 20)
    stream = client.chat.completions.create(model="sim-7b", messages=MSG, max_tokens=tokens, stream=True,
                                            extra_headers={"x-sim-decode-tps": "20", "x-sim-ttft-ms": "0"})
    for i, _ in enumerate(stream):
        if i == 1:
            started.set()


def test_the_default_pool_holds_what_the_open_files_limit_holds(proxy):
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # (the app raised this process's soft limit to the hard one)
    started = threading.Event()
    holder = threading.Thread(target=hold, args=(proxy, 1.0, started))
    holder.start()
    started.wait(10)
    label = proxy.settings.upstream_label
    assert scraped(proxy.url, "llmproxy_upstream_pool_limit", upstream=label) == (soft - RESERVE) // 2
    assert scraped(proxy.url, "llmproxy_upstream_pool_connections", upstream=label, state="in_use") == 1
    holder.join()
    proxy.last_record()
    assert scraped(proxy.url, "llmproxy_upstream_pool_connections", upstream=label, state="in_use") == 0
    assert scraped(proxy.url, "llmproxy_upstream_pool_connections", upstream=label, state="idle") == 1  # kept for reuse
    assert proxy.sample("llmproxy_upstream_pool_waits_total", {"upstream": label, "result": "waited"}) == 0


def test_a_full_pool_is_an_immediate_named_503_not_a_wait(proxy_factory):
    server = proxy_factory(max_connections=1)  # --pool-timeout 0, the default
    started = threading.Event()
    holder = threading.Thread(target=hold, args=(server, 1.5, started))
    holder.start()
    started.wait(10)
    client = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0)
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="sim-7b", messages=MSG, max_tokens=2)
    answered_in = time.monotonic() - began
    holder.join()
    assert refused.value.status_code == 503 and answered_in < 0.5  # not queued behind the 1.5 s stream
    assert refused.value.body["code"] == "proxy_overloaded" and "--max-connections" in refused.value.body["message"]
    assert refused.value.response.headers["retry-after"] == "1"
    records = server.wait_records(2)
    shed = next(r for r in records if r["outcome"] == "overloaded")
    assert shed["error"] == "proxy_overloaded:pool"
    label = server.settings.upstream_label
    assert server.sample("llmproxy_requests_rejected_total", {"upstream": label, "reason": "pool"}) == 1
    assert server.sample("llmproxy_upstream_pool_waits_total", {"upstream": label, "result": "refused"}) == 1
    assert server.sample("llmproxy_upstream_pool_waits_total", {"upstream": label, "result": "waited"}) == 0


def test_a_bounded_pool_wait_is_the_phase_wait_never_network(proxy_factory):
    """One connection, held for about 1 s by a stream; a second request waits for it (--pool-timeout 5):
    its wait is the phase `wait` (within 150 ms of the holder's remaining time), its network phase stays
    the loopback's, it is the span `proxy.wait` and is counted as a pool wait."""
    server = proxy_factory(max_connections=1, pool_timeout=5.0)
    started = threading.Event()
    holder = threading.Thread(target=hold, args=(server, 1.0, started))
    holder.start()
    started.wait(10)
    began = time.monotonic()
    response = httpx.post(f"{server.v1}/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 2, "stream": True},
                          headers={"x-sim-ttft-ms": "50", "x-sim-decode-tps": "1000"}, timeout=30)
    waited_about = time.monotonic() - began - 0.05
    holder.join()
    assert response.status_code == 200
    records = server.wait_records(2)
    waited = max(records, key=lambda r: r["phases_s"].get("wait", 0.0))
    assert waited["outcome"] == "ok" and 0.5 < waited["phases_s"]["wait"] <= waited_about + 0.01
    assert waited["phases_s"]["wait"] == pytest.approx(waited_about, abs=0.15)
    assert waited["phases_s"]["network"] < 0.05
    assert waited["phases_s"]["prefill"] == pytest.approx(0.05, abs=0.03)  # the engine's own time, untouched
    assert waited["ttft_s"] > waited["phases_s"]["wait"]
    label = server.settings.upstream_label
    assert server.sample("llmproxy_upstream_pool_waits_total", {"upstream": label, "result": "waited"}) == 1
    wait_total = server.sample("llmproxy_phase_seconds_total", {"model": "sim-7b", "upstream": label, "endpoint": "chat", "stream": "true",
                                                                 "phase": "wait"})
    assert wait_total == pytest.approx(waited["phases_s"]["wait"] + min(r["phases_s"]["wait"] for r in records), abs=1e-6)
    server.assert_all_finished()
    spans = [s for s in server.exporter.get_finished_spans() if s.name == "proxy.wait"]
    assert len(spans) == 1 and (spans[0].end_time - spans[0].start_time) / 1e9 == pytest.approx(waited["phases_s"]["wait"], abs=0.002)


def test_a_pool_wait_past_the_first_token_limit_is_still_the_proxys(proxy_factory):
    """--pool-timeout longer than --first-token-timeout: the first-token limit ends the wait, and the
    503 names the proxy's pool, not an upstream timeout (the upstream never saw the request)."""
    server = proxy_factory(max_connections=1, pool_timeout=5.0, first_token_timeout=0.5)
    started = threading.Event()
    holder = threading.Thread(target=hold, args=(server, 1.5, started))  # (its own first token comes at once)
    holder.start()
    started.wait(10)
    response = httpx.post(f"{server.v1}/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 2}, timeout=30)
    holder.join()
    assert response.status_code == 503 and response.json()["error"]["code"] == "proxy_overloaded"
    assert "first-token limit" in response.json()["error"]["message"]
    shed = next(r for r in server.wait_records(2) if r["outcome"] == "overloaded")
    assert shed["error"] == "proxy_overloaded:pool" and 0.4 < shed["duration_s"] < 1.0


def test_a_pooled_connections_rtt_is_read_on_its_first_request_then_once_a_second(sim, monkeypatch):
    """The kernel's smoothed RTT is a system call to read (15-20 µs of a request under load): a pooled
    connection's is read with its first request, then given to the next ones until it is RTT_EVERY_NS old."""
    import asyncio

    from proxy.upstream import pool as U
    from proxy.config import Settings
    from proxy.measure.timing import RequestTiming, now_ns

    reads: list[float | None] = []
    real = U.socket_rtt_s

    def spy(sock):
        reads.append(real(sock))
        return reads[-1]

    monkeypatch.setattr(U, "socket_rtt_s", spy)

    async def requests() -> list[RequestTiming]:
        pool = U.Pool(Settings(upstream=f"{sim.url}/v1"))
        timings = []
        for i in range(3):
            t = RequestTiming(received_ns=now_ns())
            connection = await pool.send("GET", b"/health", [(b"host", b"127.0.0.1")], b"", t)
            while await connection.read():
                pass
            if i == 1:
                connection.rtt_ns -= U.RTT_EVERY_NS  # (its reading made a second older)
            pool.release(connection)
            timings.append(t)
        return timings

    first, second, third = asyncio.run(requests())
    assert second.reused and third.reused  # (one connection throughout)
    assert len(reads) == 2  # the first request's, and the third's (the reading then a second old); not the second's
    assert first.rtt_s == reads[0] and first.rtt_s is not None and 0 < first.rtt_s < 0.01
    assert second.rtt_s == reads[0] and third.rtt_s == reads[1]


@pytest.mark.parametrize("close", ["fin", "reset"])
def test_a_pooled_connection_closed_under_the_request_is_sent_again_once(proxy_factory, close):
    """llama.cpp closes every connection after a stream while its answer says keep-alive, and its FIN
    can trail the stream's end (a CI run's 502 on /v1/responses). An upstream that closes a kept
    connection exactly as the next request arrives, unanswered: each request still gets its answer,
    on one new connection each, counted as reused="stale"; the lost try is booked as network."""
    chunk = b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    with raw_upstream([chunk, b"data: [DONE]\n\n"], then=close) as up:
        proxy = proxy_factory(upstream=up.url)
        client = openai.OpenAI(base_url=proxy.v1, api_key="k", max_retries=0)
        for _ in range(4):
            got = [c.choices[0].delta.content for c in client.chat.completions.create(model="m", messages=MSG, stream=True)]
            assert got == ["hi"]
            # (the client is done at [DONE]; the proxy pools the connection when it reads the upstream's last chunk,
            # a moment later: a request sent at once may find the pool empty and go out on a new connection)
            time.sleep(0.2)
        records = proxy.wait_records(4)
    label = proxy.settings.upstream_label
    counted = {reused: proxy.sample("llmproxy_upstream_connections_total", {"upstream": label, "reused": reused}) or 0
               for reused in ("stale", "false", "true")}
    assert len(up.requests) == 4 and up.accepted == 4  # each answered once; one new connection per closed one
    assert counted["stale"] >= 2 and counted["stale"] + counted["false"] == 4 and counted["true"] == 0, counted
    assert all(r["outcome"] == "ok" for r in records)
    assert [r["reused_connection"] for r in records] == [False] * 4
