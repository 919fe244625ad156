"""Anthropic's Messages API measured like chat: the official `anthropic` client (the stream helper
and `messages.create`) through the proxy, against the simulator's known schedule, and recorded
bytes of the shapes Anthropic sends (thinking, tool use, redacted thinking, errors)."""
from __future__ import annotations

import anthropic
import httpx
import orjson
import pytest
from opentelemetry.trace import SpanKind

from proxy.apis.anthropic import Anthropic
from proxy.wire.sse import SSEDecoder
from servers import ProxyServer, raw_upstream

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "user", "content": "hello there"}]


def client(server: ProxyServer, key: str = "sk-ant-test") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def test_the_stream_helper_is_timed_like_chat(proxy, sim):
    headers = {"x-sim-ttft-ms": "200", "x-sim-decode-tps": "50"}
    with client(proxy).messages.stream(model="claude-sim", max_tokens=51, messages=MESSAGES, extra_headers=headers) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) == 51 and "".join(texts) == final.content[0].text
    record = proxy.last_record()
    assert record["api"] == "anthropic" and record["endpoint"] == "messages" and record["model"] == "claude-sim"
    assert record["stream"] is True and record["outcome"] == "ok" and record["status_code"] == 200
    delivered = sim.delivered()  # 200 ms, then 50 gaps of 20 ms, as the simulator really wrote them
    assert delivered.holds_ttft(record) and delivered.holds_rate(record["decode_tokens_per_second"], 50)
    assert record["content_chunks"] == 51 and record["token_source"] == "usage"
    assert record["completion_tokens"] == final.usage.output_tokens == 51
    assert record["prompt_tokens"] == final.usage.input_tokens and record["dominant_phase"] == "decode"
    assert proxy.sample("llmproxy_requests_total", {"model": "claude-sim", "upstream": proxy.settings.upstream_label, "endpoint": "messages",
                                                    "stream": "true", "api": "anthropic", "outcome": "ok", "code": "200"}) == 1
    server_span = next(s for s in proxy.exporter.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert server_span.attributes["gen_ai.provider.name"] == "anthropic" and server_span.attributes["llmproxy.api"] == "anthropic"
    assert server_span.attributes["gen_ai.operation.name"] == "chat"


def test_pings_before_the_first_token_are_not_content(proxy):
    """`ping` events every 50 ms while a 300 ms prefill runs (as Anthropic keeps a stream alive):
    TTFT is the first delta's, not the first ping's."""
    with client(proxy).messages.stream(model="claude-sim", max_tokens=5, messages=MESSAGES,
                                       extra_headers={"x-sim-ttft-ms": "300", "x-sim-keepalive-ms": "50"}) as stream:
        stream.until_done()
    record = proxy.last_record()
    assert record["ttft_s"] == pytest.approx(0.300, abs=0.015) and record["content_chunks"] == 5 and record["malformed_chunks"] == 0


def test_create_streamed_and_not_bytes_unchanged(proxy, sim):
    events = list(client(proxy).messages.create(model="claude-sim", max_tokens=8, messages=MESSAGES, stream=True))
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    body = {"model": "claude-sim", "max_tokens": 8, "messages": MESSAGES, "stream": True}
    direct = httpx.post(f"{sim.url}/v1/messages", json=body, timeout=30).content
    via = httpx.post(f"{proxy.url}/v1/messages", json=body, timeout=30).content
    assert via == direct and b"event: message_stop" in via  # nothing injected, nothing stripped
    message = client(proxy).messages.create(model="claude-sim", max_tokens=6, messages=MESSAGES)
    record = proxy.last_record()
    assert record["stream"] is False and record["completion_tokens"] == message.usage.output_tokens == 6
    assert record["prompt_tokens"] == message.usage.input_tokens and "server" in record["phases_s"]


def test_thinking_tool_use_cached_and_redacted(proxy):
    with client(proxy).messages.stream(model="claude-sim", max_tokens=10, messages=MESSAGES,
                                       extra_headers={"x-sim-visible-reasoning": "4", "x-sim-ttft-ms": "50"}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    record = proxy.last_record()
    assert record["content_chunks"] == 14 and record["reasoning_tokens"] == 4 and record["hidden_reasoning_tokens"] == 0
    assert record["completion_tokens"] == 14  # thinking is decode: streamed, visible

    with client(proxy).messages.stream(model="claude-sim", max_tokens=6, messages=MESSAGES, tools=[{"name": "lookup", "input_schema": {"type": "object"}}],
                                       extra_headers={"x-sim-delta-field": "function_call", "x-sim-ttft-ms": "50"}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input["q"].startswith(" the")
    assert proxy.last_record()["content_chunks"] == 6  # each input_json_delta is content

    client(proxy).messages.create(model="claude-sim", max_tokens=5, messages=[{"role": "user", "content": "word " * 400}], stream=True,
                                  extra_headers={"x-sim-cached-tokens": "300"}).close()
    record = proxy.last_record()
    assert record["cached_prompt_tokens"] == 300 and record["prompt_tokens"] > 300  # prompt = uncached + cache reads

    events = list(client(proxy).messages.create(model="claude-sim", max_tokens=10, messages=MESSAGES, stream=True,
                                                extra_headers={"x-sim-hidden-reasoning": "30", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "50"}))
    assert any(e.type == "content_block_start" and e.content_block.type == "redacted_thinking" for e in events)
    record = proxy.last_record()
    assert record["hidden_reasoning_tokens"] == 30 and record["completion_tokens"] == 40
    assert record["phases_s"]["reasoning"] == pytest.approx(0.30, abs=0.03)  # 30 hidden tokens at the measured 100 tok/s


def test_errors_count_tokens_and_the_key(proxy_factory, sim, monkeypatch):
    proxy = proxy_factory()
    with pytest.raises(anthropic.APIStatusError):
        client(proxy).messages.create(model="claude-sim", max_tokens=5, messages=MESSAGES, extra_headers={"x-sim-error-status": "529"})
    assert proxy.last_record()["outcome"] == "upstream_error" and proxy.last_record()["status_code"] == 529
    with pytest.raises(anthropic.APIStatusError, match="overloaded_error"):  # the SDK raises on an `error` event
        list(client(proxy).messages.create(model="claude-sim", max_tokens=5, messages=MESSAGES, stream=True,
                                           extra_headers={"x-sim-stream-error": "1"}))
    record = proxy.last_record()
    assert record["outcome"] == "upstream_error" and record["error"] == "stream_error:overloaded_error" and record["content_chunks"] == 5
    counted = client(proxy).messages.count_tokens(model="claude-sim", messages=MESSAGES)
    assert counted.input_tokens > 0 and proxy.last_record()["endpoint"] == "messages_other"
    assert sim.stats()["last_headers"]["authorization"] == "Bearer sk-ant-test"  # forwarded as it came (this SDK sends Bearer)
    httpx.post(f"{proxy.url}/v1/messages", json={"model": "m", "max_tokens": 2, "messages": MESSAGES}, headers={"x-api-key": "sk-ant-raw"})
    assert sim.stats()["last_headers"]["x-api-key"] == "sk-ant-raw"  # Claude Code's header, forwarded as it came

    monkeypatch.setenv("ANTHROPIC_KEY_FOR_UPSTREAM", "sk-ant-upstream")
    keyed = proxy_factory(upstream_api_key_env="ANTHROPIC_KEY_FOR_UPSTREAM", upstream_api_key="sk-ant-upstream", api_key="proxy-key")
    client(keyed, key="proxy-key").messages.create(model="claude-sim", max_tokens=3, messages=MESSAGES)
    seen = sim.stats()["last_headers"]
    assert seen["x-api-key"] == "sk-ant-upstream" and "authorization" not in seen  # the proxy's key never goes on
    with pytest.raises(anthropic.AuthenticationError):
        client(keyed, key="wrong").messages.create(model="claude-sim", max_tokens=3, messages=MESSAGES)


# Recorded shapes: what Anthropic's API streams, byte for byte (event names and payloads from its
# documentation's examples), figures computed by hand below.
THINKING_TOOL_STREAM = b"".join([
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_01","type":"message","role":"assistant","model":"claude-sonnet-4-5",'
    b'"content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":120,"cache_creation_input_tokens":30,"cache_read_input_tokens":850,"output_tokens":1}}}\n\n',
    b'event: ping\ndata: {"type": "ping"}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Let me"}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":" check."}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQBCgIYAhIM"}}\n\n',
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01","name":"get_weather","input":{}}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\\"city\\": \\"Par"}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"is\\"}"}}\n\n',
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":89}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
])


def test_recorded_thinking_and_tool_use_read_by_hand():
    dialect = Anthropic()
    chunks = [dialect.event(e.data) for e in SSEDecoder().feed(THINKING_TOOL_STREAM) if e.data]
    content = [c for c in chunks if c.texts]
    # 2 thinking deltas + 2 non-empty tool-input deltas; the signature, the empty partial_json and ping are not content
    assert [c.text for c in content] == ["Let me", " check.", '{"city": "Par', 'is"}'] and [c.reasoning for c in content] == [True, True, False, False]
    usage: dict = {}
    for c in chunks:
        usage.update(c.usage or {})
    assert usage["prompt_tokens"] == 120 + 30 + 850 and usage["prompt_tokens_details"]["cached_tokens"] == 850
    assert usage["completion_tokens"] == 89 and chunks[-1].final and chunks[0].model == "claude-sonnet-4-5"


def test_recorded_stream_through_the_proxy(proxy_factory):
    """The recorded bytes, one event per 10 ms write, through the proxy: bytes unchanged; TTFT at the
    first thinking delta (the 4th write), prefill over the uncached 150 tokens."""
    writes = [e.raw for e in SSEDecoder().feed(THINKING_TOOL_STREAM)]
    with raw_upstream(writes, gap_s=0.010) as up:
        proxy = proxy_factory(upstream=up.url)
        body = orjson.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": MESSAGES, "stream": True})
        via = httpx.post(f"{proxy.url}/v1/messages", content=body, headers={"content-type": "application/json"}, timeout=30).content
        record = proxy.last_record()
    assert via == THINKING_TOOL_STREAM
    # writes 1..4 at 10 ms each: the first delta is the 4th (the prefill phase: TTFT less the connect
    # and the proxy's own time, which this in-process upstream's thread makes noisy)
    # (its sleeps never end early, so the lower bound is tight: TTFT at message_start would read 10 ms)
    assert 0.039 <= record["phases_s"]["prefill"] <= 0.060
    assert record["content_chunks"] == 4 and record["completion_tokens"] == 89 and record["cached_prompt_tokens"] == 850
    assert record["prompt_tokens"] == 1000 and record["response_model"] == "claude-sonnet-4-5"
    assert record["prefill_tokens_per_second"] == pytest.approx(150 / record["phases_s"]["prefill"], rel=1e-6)


def test_a_truncated_stream_and_a_body_of_another_shape(proxy_factory):
    writes = [e.raw for e in SSEDecoder().feed(THINKING_TOOL_STREAM)][:5]  # cut after the second thinking delta
    with raw_upstream(writes, gap_s=0.005, close=True) as up:
        proxy = proxy_factory(upstream=up.url)
        body = orjson.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": MESSAGES, "stream": True})
        got = b""
        with pytest.raises(httpx.RemoteProtocolError):  # the stream breaks for the client as it would directly
            with httpx.stream("POST", f"{proxy.url}/v1/messages", content=body, timeout=30) as response:
                for part in response.iter_raw():
                    got += part
        record = proxy.last_record()
    assert got == b"".join(writes)  # nothing lost before the break
    assert record["outcome"] == "upstream_error" and record["error"] == "mid_stream:upstream_protocol_error"
    assert record["content_chunks"] == 2 and record["prompt_tokens"] == 1000 and record["completion_tokens"] == 4  # "Let| me| check|." by the tokenizer

    odd = [b'data: {"choices": [{"delta": {"content": "not anthropic"}}]}\n\n', b'data: [1, 2]\n\n']
    with raw_upstream(odd, gap_s=0.005) as up:
        proxy = proxy_factory(upstream=up.url)
        via = httpx.post(f"{proxy.url}/v1/messages", content=b'{"model": "m", "stream": true}', timeout=30).content
        record = proxy.last_record()
    assert via == b"".join(odd) and record["content_chunks"] == 0 and record["malformed_chunks"] == 1 and record["outcome"] == "ok"
