"""Gemini's API measured like chat: the official `google-genai` client through the proxy (stream
and not) against the simulator's schedule, recorded bytes of both stream shapes (SSE with thought
parts, the JSON array), and the key in the query string kept out of every record."""
from __future__ import annotations

import logging

import httpx
import orjson
import pytest
from google import genai
from google.genai import types

from servers import raw_upstream

pytestmark = pytest.mark.e2e
SCHEDULE = {"x-sim-ttft-ms": "200", "x-sim-decode-tps": "50"}


def client(server, headers: dict[str, str] | None = None, key: str = "goog-test-key") -> genai.Client:
    return genai.Client(api_key=key, http_options=types.HttpOptions(base_url=server.url, headers=headers or {}))


def test_stream_and_not_through_the_sdk(proxy_factory, sim):
    proxy = proxy_factory(upstream=sim.url)
    sdk = client(proxy, SCHEDULE)  # (kept: the SDK closes its HTTP client when the Client is collected)
    out = list(sdk.models.generate_content_stream(
        model="gemini-sim", contents="hello there", config=types.GenerateContentConfig(max_output_tokens=51)))
    assert len(out) == 51 and out[-1].usage_metadata.candidates_token_count == 51
    record = proxy.last_record()
    assert record["api"] == "gemini" and record["endpoint"] == "generate_content" and record["model"] == "gemini-sim"
    assert record["stream"] is True and record["outcome"] == "ok" and record["token_source"] == "usage"
    delivered = sim.delivered()
    assert delivered.holds_ttft(record) and delivered.holds_rate(record["decode_tokens_per_second"], 50)
    assert record["completion_tokens"] == 51 and record["prompt_tokens"] == out[-1].usage_metadata.prompt_token_count
    assert sim.stats()["last_headers"]["x-goog-api-key"] == "goog-test-key"  # forwarded as it came
    whole = sdk.models.generate_content(model="gemini-sim", contents="hello there",
                                                  config=types.GenerateContentConfig(max_output_tokens=6))
    record = proxy.last_record()
    assert record["stream"] is False and record["completion_tokens"] == whole.usage_metadata.candidates_token_count == 6
    assert proxy.sample("llmproxy_requests_total", {"model": "gemini-sim", "upstream": proxy.settings.upstream_label, "endpoint": "generate_content",
                                                    "stream": "false", "api": "gemini", "outcome": "ok", "code": "200"}) == 1


def test_visible_thoughts_hidden_thoughts_and_the_array_stream(proxy_factory, sim):
    proxy = proxy_factory(upstream=sim.url)
    visible = client(proxy, {"x-sim-visible-reasoning": "4", "x-sim-ttft-ms": "50"})
    list(visible.models.generate_content_stream(
        model="gemini-sim", contents="hi", config=types.GenerateContentConfig(max_output_tokens=10)))
    record = proxy.last_record()
    assert record["content_chunks"] == 14 and record["reasoning_tokens"] == 4 and record["hidden_reasoning_tokens"] == 0
    hidden = client(proxy, {"x-sim-hidden-reasoning": "30", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "50"})
    list(hidden.models.generate_content_stream(
        model="gemini-sim", contents="hi", config=types.GenerateContentConfig(max_output_tokens=10)))
    record = proxy.last_record()
    assert record["hidden_reasoning_tokens"] == 30 and record["completion_tokens"] == 40
    assert record["phases_s"]["reasoning"] == pytest.approx(0.30, abs=0.03)
    # Without alt=sse: one JSON array, element by element, framed as it comes.
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 21}}
    with httpx.stream("POST", f"{proxy.url}/v1beta/models/gemini-sim:streamGenerateContent", json=body, headers=SCHEDULE, timeout=30) as r:
        raw = b"".join(r.iter_raw())
    delivered = sim.delivered()  # (TTFT 200 ms as scheduled, as the simulator really wrote it)
    assert raw.startswith(b"[{") and raw.endswith(b"]") and len(orjson.loads(raw)) == 21
    record = proxy.last_record()
    assert delivered.ttft_s == pytest.approx(0.200, abs=0.050)  # (the schedule was applied)
    assert delivered.holds_ttft(record) and record["content_chunks"] == 21 and record["completion_tokens"] == 21


# Recorded shapes, as Gemini sends them (SSE frames end in \r\n\r\n; the array's elements are
# separated by ",\r\n"); figures computed by hand below.
SSE = [
    b'data: {"candidates": [{"content": {"parts": [{"text": "Let me think", "thought": true}],"role": "model"},"index": 0}],'
    b'"usageMetadata": {"promptTokenCount": 1200,"cachedContentTokenCount": 1000,"totalTokenCount": 1200,"thoughtsTokenCount": 3},"modelVersion": "gemini-2.5-flash"}\r\n\r\n',
    b'data: {"candidates": [{"content": {"parts": [{"text": "Paris is"}],"role": "model"},"index": 0}],'
    b'"usageMetadata": {"promptTokenCount": 1200,"cachedContentTokenCount": 1000,"candidatesTokenCount": 2,"totalTokenCount": 1205,"thoughtsTokenCount": 3},"modelVersion": "gemini-2.5-flash"}\r\n\r\n',
    b'data: {"candidates": [{"content": {"parts": [{"functionCall": {"name": "weather", "args": {"city": "Paris"}}}],"role": "model"},"finishReason": "STOP","index": 0}],'
    b'"usageMetadata": {"promptTokenCount": 1200,"cachedContentTokenCount": 1000,"candidatesTokenCount": 9,"totalTokenCount": 1212,"thoughtsTokenCount": 3},"modelVersion": "gemini-2.5-flash"}\r\n\r\n',
]
ARRAY = [b"[" + SSE[0][6:-4], b",\r\n" + SSE[1][6:-4], b",\r\n" + SSE[2][6:-4], b"]"]


def test_candidates_are_choices():
    """candidateCount > 1: each candidate is its own sequence, as `choices[].index` is for chat."""
    from proxy.apis.gemini import Gemini

    event = orjson.dumps({"candidates": [{"content": {"parts": [{"text": " a"}]}, "index": 0},
                                         {"content": {"parts": [{"text": " b c"}]}, "index": 1}]})
    assert Gemini().event(event).texts == [(0, " a"), (1, " b c")]


@pytest.mark.parametrize("shape", ["sse", "array"])
def test_recorded_streams_read_by_hand(proxy_factory, shape):
    writes, alt = (SSE, "?alt=sse") if shape == "sse" else (ARRAY, "")
    with raw_upstream(writes, gap_s=0.010, content_type="text/event-stream" if shape == "sse" else "application/json") as up:
        proxy = proxy_factory(upstream=up.url)
        with httpx.stream("POST", f"{proxy.url}/v1beta/models/gemini-2.5-flash:streamGenerateContent{alt}", json={"contents": "hi"},
                          timeout=30) as response:
            via = b"".join(response.iter_raw())
        record = proxy.last_record()
    assert via == b"".join(writes)
    # 3 content events: the thought, the text, the function call's args; 10 ms apart
    # The upstream waits 10 ms before its first write: the prefill phase (TTFT less the connect and
    # the proxy's own time, which this in-process upstream's thread makes noisy) is that wait.
    # (its sleeps never end early, so the lower bound is tight; the upper one allows a busy machine)
    assert record["content_chunks"] == 3 and 0.009 <= record["phases_s"]["prefill"] <= 0.025
    assert 0.015 <= record["decode_s"] <= 0.040  # 2 gaps of 10 ms (generous: the fixture is a thread of this busy process)
    assert record["prompt_tokens"] == 1200 and record["cached_prompt_tokens"] == 1000
    assert record["completion_tokens"] == 9 + 3 and record["reasoning_tokens"] == 3 and record["hidden_reasoning_tokens"] == 0
    assert record["response_model"] == "gemini-2.5-flash" and record["model"] == "gemini-2.5-flash"


def test_bad_input_and_the_key_in_the_query(proxy_factory, caplog):
    caplog.set_level(logging.INFO)  # the request log (info) of both proxies below
    cut = [ARRAY[0], ARRAY[1][: len(ARRAY[1]) // 2]]  # the array stream cut mid-element
    with raw_upstream(cut, gap_s=0.005, content_type="application/json", close=True) as up:
        proxy = proxy_factory(upstream=up.url, log_requests=True)
        got = b""
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", f"{proxy.url}/v1beta/models/g:streamGenerateContent?key=QUERY-KEY-CANARY", json={"contents": "hi"},
                              timeout=30) as response:
                for part in response.iter_raw():
                    got += part
        record = proxy.last_record()
        assert got == b"".join(cut) and record["content_chunks"] == 1 and record["outcome"] == "upstream_error"
        assert up.requests[-1]["request-line"] == "POST /v1beta/models/g:streamGenerateContent?key=QUERY-KEY-CANARY HTTP/1.1"
    error = [ARRAY[0], b',\r\n{"error": {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"}}', b"]"]
    with raw_upstream(error, gap_s=0.005, content_type="application/json") as up:
        proxy = proxy_factory(upstream=up.url, log_requests=True, api_key="proxy-key")
        assert httpx.post(f"{proxy.url}/v1beta/models/g:streamGenerateContent?key=wrong", json={"contents": "hi"}).status_code == 401
        via = httpx.post(f"{proxy.url}/v1beta/models/g:streamGenerateContent?key=proxy-key&x=1", json={"contents": "hi"}, timeout=30).content
        record = proxy.last_record()
        assert via == b"".join(error) and record["outcome"] == "upstream_error" and record["error"] == "stream_error:UNAVAILABLE"
        assert up.requests[-1]["request-line"] == "POST /v1beta/models/g:streamGenerateContent?x=1 HTTP/1.1"  # the proxy's key never goes on
        metrics = httpx.get(f"{proxy.url}/metrics").text
    with raw_upstream(SSE, content_type="text/event-stream") as up:  # an upstream key replaces the client's, in the header
        keyed = proxy_factory(upstream=up.url, upstream_api_key_env="GEMINI_KEY_FOR_UPSTREAM", upstream_api_key="upstream-goog-key")
        httpx.post(f"{keyed.url}/v1beta/models/g:streamGenerateContent?alt=sse&key=QUERY-KEY-CANARY", json={"contents": "hi"},
                   headers={"x-goog-api-key": "QUERY-KEY-CANARY"}, timeout=30)
        seen = up.requests[-1]
        assert seen["request-line"] == "POST /v1beta/models/g:streamGenerateContent?alt=sse HTTP/1.1" and seen["x-goog-api-key"] == "upstream-goog-key"
        assert keyed.last_record()["content_chunks"] == 3
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("llmproxy"))  # the proxy's logs (not the test client's)
    assert '"outcome"' in logged  # the request log was on
    for secret in ("QUERY-KEY-CANARY", "proxy-key"):
        assert secret not in logged and secret not in metrics and secret not in str(proxy.records())
