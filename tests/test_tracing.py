"""Spans from the timing record: names, parentage, attributes, token span modes."""
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.config import Settings
from proxy.measure.timing import split
from proxy.measure.tracing import Tracing

from test_timing import streaming_record

OFFSET = 1_700_000_000 * 1_000_000_000
INCOMING = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def in_memory(mode="off"):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, Tracing(provider, Settings(upstream="http://10.0.0.5:8000/v1", token_spans=mode))


def run(mode="spans"):
    exporter, tracing = in_memory(mode)
    t = streaming_record()
    t.status_code, t.response_model = 200, "m-2024"
    spans = tracing.start({"traceparent": INCOMING}, t, t.received_ns + OFFSET)
    traceparent = spans.traceparent().decode()
    tracing.finish(spans, t, split(t), OFFSET)
    return {s.name: s for s in exporter.get_finished_spans()}, exporter.get_finished_spans(), traceparent


def test_tree_and_parentage():
    by_name, spans, traceparent = run()
    server = by_name["chat m"]
    assert server.kind == SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert server.parent.span_id == 0xB7AD6B7169203331
    up = by_name["upstream.request"]
    assert up.kind == SpanKind.CLIENT and up.parent.span_id == server.context.span_id
    assert traceparent == f"00-0af7651916cd43dd8448eb211c80319c-{up.context.span_id:016x}-01"
    assert by_name["upstream.connect"].parent.span_id == up.context.span_id
    for step in ("dns", "tcp", "tls"):
        assert by_name[step].parent.span_id == by_name["upstream.connect"].context.span_id
    for child in ("tokenize", "prefill", "decode"):
        assert by_name[child].parent.span_id == server.context.span_id
    chunks = [s for s in spans if s.name == "chunk"]
    assert len(chunks) == 3 and all(c.parent.span_id == by_name["decode"].context.span_id for c in chunks)


def test_explicit_times_come_from_the_record():
    by_name, _, _ = run()
    server, decode, prefill = by_name["chat m"], by_name["decode"], by_name["prefill"]
    assert server.start_time == OFFSET and server.end_time == OFFSET + 232_000_000
    assert decode.start_time == OFFSET + 210_000_000 and decode.end_time == OFFSET + 231_000_000
    assert prefill.end_time == decode.start_time
    assert by_name["tls"].end_time - by_name["tls"].start_time == 3_000_000


def test_genai_attributes():
    by_name, _, _ = run()
    a = by_name["chat m"].attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "openai_compatible"
    assert a["gen_ai.request.model"] == "m" and a["gen_ai.response.model"] == "m-2024"
    assert a["gen_ai.usage.input_tokens"] == 1000 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.21)
    assert a["server.address"] == "10.0.0.5" and a["server.port"] == 8000
    assert a["llmproxy.decode_tokens_per_second"] == pytest.approx(100.0)
    assert a["llmproxy.phase.prefill_seconds"] > 0


def test_events_mode_and_off_mode():
    by_name, spans, _ = run("events")
    assert not [s for s in spans if s.name == "chunk"]
    assert [e.name for e in by_name["decode"].events] == ["chunk"] * 3
    _, spans, _ = run("off")
    assert not [s for s in spans if s.name == "chunk"]


def test_an_unsampled_parent_is_respected_and_still_propagated():
    exporter, tracing = in_memory()
    t = streaming_record()
    spans = tracing.start({"traceparent": INCOMING[:-2] + "00"}, t, t.received_ns + OFFSET)
    version, trace_id, span_id, flags = spans.traceparent().decode().split("-")
    assert trace_id == INCOMING.split("-")[1] and span_id != INCOMING.split("-")[2] and int(flags, 16) & 1 == 0
    tracing.finish(spans, t, split(t), OFFSET)
    assert exporter.get_finished_spans() == () and tracing.started == tracing.exported == 0


def test_a_failing_split_still_sends_the_server_and_client_spans():
    exporter, tracing = in_memory()
    t = streaming_record()
    spans = tracing.start({}, t, t.received_ns + OFFSET)
    t.content_ns[0] = "not an instant"  # type: ignore[call-overload]  # building the children raises
    with pytest.raises(TypeError):
        tracing.finish(spans, t, split(streaming_record()), OFFSET)
    names = {s.name: s.kind.name for s in exporter.get_finished_spans()}
    assert names["upstream.request"] == "CLIENT" and names["chat m"] == "SERVER" and "decode" not in names
    assert tracing.started == tracing.exported == 1
    root = next(s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert root.parent is None and root.context.trace_id == int(spans.trace_id, 16)


def test_offsets_by_default_one_per_content_chunk_from_the_record():
    """The default representation: arrays on the decode span, in µs after its start (the first chunk)."""
    by_name, spans, _ = run(Settings(upstream="http://x:1/v1").token_spans)
    decode = by_name["decode"]
    t = streaming_record()
    assert list(decode.attributes["llmproxy.chunk.offsets_us"]) == [(ns - t.content_ns[0]) // 1000 for ns in t.content_ns] == [0, 10_000, 20_000]
    assert decode.attributes["llmproxy.chunk.offsets_us"][0] == 0 and len(t.content_ns) == 3
    assert "llmproxy.chunk.choices" not in decode.attributes  # one choice: no choices array
    assert not [s for s in spans if s.name == "chunk"] and not decode.events


def test_offsets_carry_choices_and_token_counts_when_they_say_something():
    exporter, tracing = in_memory("offsets")
    t = streaming_record()
    t.status_code = 200
    t.content_choice = [0, 1, 0]
    t.chunk_tokens = [1.0, 2.5, 1.5]
    spans = tracing.start({}, t, t.received_ns + OFFSET)
    tracing.finish(spans, t, split(t), OFFSET)
    decode = next(s for s in exporter.get_finished_spans() if s.name == "decode")
    assert list(decode.attributes["llmproxy.chunk.choices"]) == [0, 1, 0]
    assert list(decode.attributes["llmproxy.chunk.tokens"]) == [1.0, 2.5, 1.5]
