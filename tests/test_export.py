"""Spans flattened for the worker process come back identical (what the OTLP encoder reads)."""
import pickle

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from proxy.config import Settings
from proxy.measure.export import flatten, rebuild
from proxy.measure.timing import split
from proxy.measure.tracing import Tracing

from test_timing import streaming_record

INCOMING = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_flatten_and_rebuild_keep_every_field_the_encoder_reads():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider, Settings(upstream="http://10.0.0.5:8000/v1", token_spans="events"))
    t = streaming_record()
    t.status_code, t.outcome, t.error = 502, "upstream_error", "mid_stream:upstream_protocol_error"
    spans = tracing.start({"traceparent": INCOMING, "tracestate": "vendor=abc"}, t, t.received_ns)
    tracing.finish(spans, t, split(t), 0)
    originals = exporter.get_finished_spans()
    assert len(originals) >= 8
    rows = pickle.loads(pickle.dumps([flatten(s) for s in originals]))  # what crosses to the worker
    resource, scope = Resource({"service.name": "x"}), InstrumentationScope("llm-latency-proxy")
    for original, row in zip(originals, rows):
        copy = rebuild(row, resource, scope)
        assert (copy.name, copy.kind, copy.start_time, copy.end_time) == (original.name, original.kind, original.start_time, original.end_time)
        assert copy.context == original.context and copy.parent == original.parent
        assert copy.context.trace_state.to_header() == "vendor=abc"
        assert dict(copy.attributes) == dict(original.attributes)
        assert (copy.status.status_code, copy.status.description) == (original.status.status_code, original.status.description)
        assert [(e.name, dict(e.attributes), e.timestamp) for e in copy.events] == [(e.name, dict(e.attributes), e.timestamp) for e in original.events]
    server = next(s for s in originals if s.parent is not None and s.parent.is_remote)
    assert server.status.status_code.name == "ERROR" and any(e.name == "chunk" for s in originals for e in s.events)
