"""The Responses API measured like chat: the official client's `responses.create(stream=True)` and
`responses.stream()` helper through the proxy, against the simulator's known schedule."""
from __future__ import annotations

import httpx
import openai
import pytest
from opentelemetry.trace import SpanKind

pytestmark = pytest.mark.e2e


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="sk-test", max_retries=0)


def create(server, tokens: int = 20, headers: dict[str, str] | None = None, stream: bool = True) -> list:
    result = client(server).responses.create(model="sim-7b", input="hello there", max_output_tokens=tokens, stream=stream,
                                             extra_headers=headers or {})
    return list(result) if stream else [result]


def test_a_streamed_response_is_timed_like_chat(proxy, sim):
    events = create(proxy, 51, {"x-sim-ttft-ms": "200", "x-sim-decode-tps": "50"})
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 51
    record = proxy.last_record()
    assert record["endpoint"] == "responses" and record["stream"] is True and record["outcome"] == "ok"
    delivered = sim.delivered()  # 200 ms, then 50 gaps of 20 ms, as the simulator really wrote them
    assert delivered.holds_ttft(record) and delivered.holds_rate(record["decode_tokens_per_second"], 50)
    assert record["content_chunks"] == 51 and record["inter_token_p50_s"] == pytest.approx(0.02, abs=0.002)
    usage = events[-1].response.usage
    assert record["completion_tokens"] == usage.output_tokens == 51 and record["token_source"] == "usage"
    assert record["prompt_tokens"] == usage.input_tokens
    assert record["dominant_phase"] == "decode"


def test_the_stream_helper_gets_the_same_response_through_the_proxy(proxy, sim):
    """Bytes unchanged: the helper's final response equals the direct one, and the raw streams match."""
    kwargs = {"model": "sim-7b", "input": "hello there", "max_output_tokens": 8}
    with client(proxy).responses.stream(**kwargs) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text and final.status == "completed"
    body = {**kwargs, "stream": True}
    direct = httpx.post(f"{sim.url}/v1/responses", json=body, timeout=30).content
    via = httpx.post(f"{proxy.v1}/responses", json=body, timeout=30).content
    assert via == direct and b"event: response.completed" in via
    assert proxy.last_record()["completion_tokens"] == 8


def test_hidden_and_visible_reasoning_tool_calls_and_cached_tokens(proxy):
    create(proxy, 10, {"x-sim-hidden-reasoning": "30", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "50"})
    hidden = proxy.last_record()
    assert hidden["hidden_reasoning_tokens"] == 30 and hidden["completion_tokens"] == 40
    assert hidden["phases_s"]["reasoning"] == pytest.approx(0.30, abs=0.03)  # 30 hidden tokens at the measured 100 tok/s
    for field in ("reasoning_text", "summary"):
        events = create(proxy, 5, {"x-sim-visible-reasoning": "4", "x-sim-reasoning-field": field, "x-sim-ttft-ms": "50"})
        kinds = [e.type for e in events]
        assert ("response.reasoning_summary_text.delta" if field == "summary" else "response.reasoning_text.delta") in kinds
        visible = proxy.last_record()
        assert visible["content_chunks"] == 9 and visible["hidden_reasoning_tokens"] == 0  # reasoning deltas are content
        assert visible["ttft_s"] == pytest.approx(0.05, abs=0.01)  # the first reasoning delta is the first token
    events = create(proxy, 6, {"x-sim-delta-field": "function_call"})
    call = events[-1].response.output[0]
    assert call.type == "function_call" and call.arguments
    assert proxy.last_record()["content_chunks"] == 6
    create(proxy, 3, {"x-sim-cached-tokens": "5"})
    assert proxy.last_record()["cached_prompt_tokens"] == 5


def test_a_non_streaming_response(proxy):
    (result,) = create(proxy, 7, {"x-sim-ttft-ms": "30"}, stream=False)
    record = proxy.last_record()
    assert result.output_text and record["endpoint"] == "responses" and record["stream"] is False
    assert record["completion_tokens"] == result.usage.output_tokens == 7 and record["token_source"] == "usage"
    assert record["ttft_s"] is None and record["outcome"] == "ok"


def test_failures_give_the_right_outcome(proxy):
    events = create(proxy, 4, {"x-sim-response-failed": "1"})
    assert events[-1].type == "response.failed"
    failed = proxy.last_record()
    assert failed["outcome"] == "upstream_error" and failed["error"] == "stream_error:server_error"
    with pytest.raises(openai.InternalServerError):
        create(proxy, 4, {"x-sim-error-status": "500"})
    assert proxy.last_record()["outcome"] == "upstream_error"


def test_stored_response_operations_pass_through_labelled_not_timed(proxy, sim):
    for method, path in (("GET", "/responses/resp_abc"), ("DELETE", "/responses/resp_abc"),
                         ("GET", "/responses/resp_abc/input_items")):
        via = httpx.request(method, f"{proxy.v1}{path}", timeout=10)
        direct = httpx.request(method, f"{sim.url}/v1{path}", timeout=10)
        assert (via.status_code, via.content) == (direct.status_code, direct.content)
        record = proxy.last_record()
        assert record["endpoint"] == "responses_other" and record["ttft_s"] is None and record["content_chunks"] == 0


def test_spans_name_the_operation_as_the_conventions_do(proxy):
    create(proxy, 3)
    proxy.last_record()
    server = [s for s in proxy.exporter.get_finished_spans() if s.kind == SpanKind.SERVER][-1]
    assert server.attributes["gen_ai.operation.name"] == "chat" and server.attributes["openai.api.type"] == "responses"
    assert server.name == "chat sim-7b" and server.attributes["gen_ai.usage.output_tokens"] == 3
    label = proxy.settings.upstream_label
    assert proxy.sample("llmproxy_requests_total", {"model": "sim-7b", "upstream": label, "endpoint": "responses", "stream": "true",
                                                    "outcome": "ok", "code": "200"}) >= 1
