"""End to end: the numbers are true against an injected schedule, as the simulator really ran it; metrics and spans carry them."""
from __future__ import annotations

import statistics
import time

import httpx
import openai
import pytest
from opentelemetry.trace import SpanKind

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "hello"}]


def stream(server, n=10, headers=None, model="sim-7b"):
    c = openai.OpenAI(base_url=server.v1, api_key="sk-test", max_retries=0)
    for _ in c.chat.completions.create(model=model, messages=MSG, max_tokens=n, stream=True, extra_headers=headers or {}):
        pass


DIRECT = httpx.Client(timeout=30)  # one client: no TLS context or connection set-up inside a timing


def direct_ttft(sim, body: dict, headers: dict) -> float:
    """Time to the first content chunk as a client talking straight to the simulator sees it."""
    start, elapsed = time.monotonic(), None
    with DIRECT.stream("POST", f"{sim.url}/v1/chat/completions", json=body, headers=headers) as r:
        for part in r.iter_raw():
            if elapsed is None and b'"content":" ' in part:
                elapsed = time.monotonic() - start
    assert elapsed is not None, "no content"
    return elapsed


def test_ttft_within_5ms_of_the_injected_schedule(sim, proxy):
    """Against the injected 200 ms as the simulator really delivered it, request by request: on a
    loaded machine its sleep overshoots by some ms, and a direct request beside it has its own."""
    headers = {"x-sim-ttft-ms": "200"}
    delivered = []
    for _ in range(5):
        stream(proxy, 3, headers)
        delivered.append(sim.delivered())
    records = proxy.wait_records(5)[-5:]
    assert abs(statistics.median(d.ttft_s for d in delivered) - 0.200) < 0.020, delivered  # the schedule was applied
    errors = sorted(r["ttft_s"] - r["phases_s"]["client"] - d.ttft_s for r, d in zip(records, delivered))
    # Never before the engine's; the median within 5 ms; every one within 10 ms (three processes share two cores here).
    assert errors[0] >= -0.0001 and errors[2] < 0.005 and errors[-1] < 0.010, (errors, delivered)


def test_ttft_follows_prompt_length_at_the_prefill_rate(sim, proxy):
    c = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    prompt = " the" * 2493  # + 7 chat tokens = 2,500 prompt tokens: 0.5 s at 5,000 tok/s
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True}
    direct = []
    for _ in range(3):  # interleaved: direct, then through the proxy
        direct.append(direct_ttft(sim, body, {}))
        for _ in c.chat.completions.create(**body):
            pass
    records = proxy.wait_records(3)[-3:]
    delivered = statistics.median(direct)
    ttft = statistics.median(r["ttft_s"] for r in records)
    prefill = statistics.median(r["phases_s"]["prefill"] for r in records)
    assert all(r["prompt_tokens"] == 2500 for r in records)
    assert abs(delivered - 0.5) < 0.02  # 2,500 tokens at 5,000 tok/s, as a direct client sees it
    assert abs(ttft - delivered) < 0.01
    assert abs(prefill - delivered) < 0.01
    assert statistics.median(r["prefill_tokens_per_second"] for r in records) == pytest.approx(2500 / delivered, rel=0.03)


def test_decode_rate_within_2_percent(proxy, sim):
    stream(proxy, 51, {"x-sim-decode-tps": "50", "x-sim-ttft-ms": "10"})
    record = proxy.last_record()
    delivered = sim.delivered()  # 1 s at 50 tok/s as scheduled, as the simulator really wrote it
    assert delivered.window_s() == pytest.approx(1.0, rel=0.05)  # (the schedule was applied)
    assert delivered.holds_rate(record["decode_tokens_per_second"], 50)  # within 1% of the truth
    assert delivered.holds_window(record["decode_s"])
    assert record["inter_token_p50_s"] == pytest.approx(0.02, abs=0.002)


def test_multi_token_chunks_split_inter_token_from_inter_chunk(proxy):
    stream(proxy, 40, {"x-sim-chunk-tokens": "4", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "10"})
    record = proxy.last_record()
    assert record["content_chunks"] == 10 and record["completion_tokens"] == 40
    assert record["inter_token_p50_s"] == pytest.approx(0.010, abs=0.0015)  # 40 ms chunk gap / 4 tokens
    labels = {"model": "sim-7b", "upstream": proxy.settings.upstream_label, "endpoint": "chat", "stream": "true"}
    assert proxy.sample("llmproxy_inter_chunk_latency_seconds_count", labels) == 9
    mean_chunk_gap = proxy.sample("llmproxy_inter_chunk_latency_seconds_sum", labels) / 9
    assert mean_chunk_gap == pytest.approx(0.040, abs=0.003)


def test_phases_sum_to_the_duration_and_decode_dominates_short_prompts(proxy):
    stream(proxy, 30, {"x-sim-decode-tps": "100"})
    record = proxy.last_record()
    assert sum(record["phases_s"].values()) == pytest.approx(record["duration_s"], abs=1e-6)
    assert record["dominant_phase"] == "decode"
    assert record["phases_s"]["network"] < 0.005 and record["phases_s"]["proxy"] < 0.005


def test_connection_reuse_is_seen(proxy):
    stream(proxy, 2)
    stream(proxy, 2)
    first, second = proxy.wait_records(2)[-2:]
    assert first["reused_connection"] is False and "tcp" in first["connect_s"]
    assert second["reused_connection"] is True and second["connect_s"] == {}
    assert second["rtt_s"] is not None and 0 < second["rtt_s"] < 0.01
    up = proxy.settings.upstream_label
    assert proxy.sample("llmproxy_upstream_connections_total", {"upstream": up, "reused": "true"}) == 1
    assert proxy.sample("llmproxy_upstream_connect_seconds_count", {"upstream": up, "step": "tcp"}) == 1


def test_metrics_scraped_from_the_endpoint(proxy):
    for _ in range(3):
        stream(proxy, 4)
    proxy.wait_records(3)
    text = httpx.get(f"{proxy.url}/metrics").text
    up = proxy.settings.upstream_label
    line = f'llmproxy_requests_total{{api="openai",code="200",endpoint="chat",model="sim-7b",outcome="ok",stream="true",tenant="unknown",upstream="{up}"}} 3.0'
    assert line in text
    assert f'llmproxy_time_to_first_token_seconds_count{{endpoint="chat",model="sim-7b",stream="true",tenant="unknown",upstream="{up}"}} 3.0' in text
    assert f'llmproxy_requests_in_flight{{upstream="{up}"}} 0.0' in text
    openmetrics = httpx.get(f"{proxy.url}/metrics", headers={"accept": "application/openmetrics-text"}).text
    assert '# {trace_id="' in openmetrics


def test_spans_and_trace_context_end_to_end(sim, proxy_factory):
    proxy = proxy_factory(token_spans="spans")
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    stream(proxy, 5, {"traceparent": incoming})
    proxy.last_record()
    spans = proxy.exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    server = by_name["chat sim-7b"]
    assert server.kind == SpanKind.SERVER and server.parent.span_id == 0x00F067AA0BA902B7
    assert format(server.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    upstream = by_name["upstream.request"]
    sent = sim.stats()["last_headers"]["traceparent"]
    assert sent == f"00-4bf92f3577b34da6a3ce929d0e0e4736-{upstream.context.span_id:016x}-01"
    assert len([s for s in spans if s.name == "chunk"]) == 5
    assert {"tokenize", "prefill", "decode", "upstream.connect", "tcp"} <= set(by_name)
    assert server.attributes["gen_ai.usage.output_tokens"] == 5


def test_model_label_is_capped(proxy_factory):
    server = proxy_factory(max_models=2)
    for model in ("a", "b", "c", "d"):
        stream(server, 1, model=model)
    server.wait_records(4)
    up = server.settings.upstream_label
    base = {"upstream": up, "endpoint": "chat", "stream": "true", "outcome": "ok", "code": "200"}
    assert server.sample("llmproxy_requests_total", {**base, "model": "other"}) == 2
    assert server.sample("llmproxy_requests_total", {**base, "model": "c"}) is None


def test_median_ttft_overhead_vs_direct_is_small(sim, proxy):
    """A sanity bound only (real figures live in bench/): the proxy adds well under 50 ms."""
    def ttft(url):
        c = openai.OpenAI(base_url=url, api_key="sk-test", max_retries=0)
        import time
        start = time.perf_counter()
        for chunk in c.chat.completions.create(model="sim-7b", messages=MSG, max_tokens=2, stream=True, extra_headers={"x-sim-ttft-ms": "20"}):
            if chunk.choices and chunk.choices[0].delta.content:
                return time.perf_counter() - start
    direct = statistics.median(ttft(f"{sim.url}/v1") for _ in range(10))
    via = statistics.median(ttft(proxy.v1) for _ in range(10))
    assert via - direct < 0.050
