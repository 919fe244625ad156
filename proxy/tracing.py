"""OpenTelemetry spans built from the timing record, with explicit start and end times.

Two spans are opened when the request starts, only because their ids must exist early: the SERVER
span (its parent is the app's incoming `traceparent`) and the CLIENT `upstream.request` span (its
context goes upstream as `traceparent`, so vLLM's spans join the trace). Everything else is
created at finalize from recorded instants: the hot loop never touches tracing.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .config import Settings
from .timing import Breakdown, RequestTiming

OPERATIONS = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings", "other": "proxy"}
_PROPAGATOR = TraceContextTextMapPropagator()


class CountingExporter(SpanExporter):
    """Counts failed exports (OTLP endpoint down) instead of letting them pass unseen."""

    def __init__(self, inner: SpanExporter, on_error: Callable[[str], None]) -> None:
        self.inner = inner
        self.on_error = on_error

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # the exporter thread must survive; the failure is counted
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.on_error("otlp_export")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def build_tracer_provider(settings: Settings, on_error: Callable[[str], None]) -> TracerProvider | None:
    """A provider exporting OTLP/HTTP when an endpoint is configured, else None (tracing off)."""
    env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not (settings.otlp_endpoint or env_endpoint):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if settings.otlp_endpoint:
        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint.rstrip("/") + "/v1/traces")
    else:
        exporter = OTLPSpanExporter()  # reads the standard OTEL_EXPORTER_OTLP_* variables
    name = settings.service_name or os.environ.get("OTEL_SERVICE_NAME") or "llm-latency-proxy"
    provider = TracerProvider(resource=Resource.create({"service.name": name, "process.pid": os.getpid()}))
    provider.add_span_processor(BatchSpanProcessor(CountingExporter(exporter, on_error)))
    return provider


class RequestSpans:
    __slots__ = ("server", "upstream")

    def __init__(self, server: Any, upstream: Any) -> None:
        self.server = server
        self.upstream = upstream

    @property
    def trace_id(self) -> str:
        return format(self.server.get_span_context().trace_id, "032x")

    def traceparent(self) -> bytes:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.upstream))
        return carrier["traceparent"].encode()


class Tracing:
    def __init__(self, provider: TracerProvider | None, settings: Settings) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("llm-latency-proxy") if provider is not None else None
        self.settings = settings
        _, self.host, self.port, _ = settings.upstream_parts

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def start(self, headers: dict[str, str], t: RequestTiming, wall_ns: int) -> RequestSpans:
        parent = _PROPAGATOR.extract(headers)
        server = self.tracer.start_span(f"{OPERATIONS[t.endpoint]} {t.model}", context=parent, kind=SpanKind.SERVER, start_time=wall_ns)
        ctx = trace.set_span_in_context(server)
        upstream = self.tracer.start_span("upstream.request", context=ctx, kind=SpanKind.CLIENT, start_time=wall_ns)
        return RequestSpans(server, upstream)

    def finish(self, spans: RequestSpans, t: RequestTiming, b: Breakdown, offset_ns: int) -> None:
        """Attributes and child spans from the record; ends both open spans."""
        tracer = self.tracer
        wall = lambda ns: ns + offset_ns  # noqa: E731 - monotonic instant to epoch ns
        end_ns = t.response_end_ns or t.received_ns
        server, upstream = spans.server, spans.upstream
        server.update_name(f"{OPERATIONS[t.endpoint]} {t.model}")
        server.set_attributes(self._attributes(t, b))
        if t.outcome != "ok":
            server.set_status(Status(StatusCode.ERROR, t.outcome))
            server.set_attribute("error.type", t.error or t.outcome)
        server_ctx = trace.set_span_in_context(server)
        up_ctx = trace.set_span_in_context(upstream)
        upstream.set_attributes({"server.address": self.host, "server.port": self.port, "http.response.status_code": t.status_code})
        if t.tcp_start_ns is not None:
            connect_start = t.dns_start_ns or t.tcp_start_ns
            connect_end = t.tls_end_ns or t.tcp_end_ns or connect_start
            conn = tracer.start_span("upstream.connect", context=up_ctx, start_time=wall(connect_start))
            conn_ctx = trace.set_span_in_context(conn)
            steps = (("dns", t.dns_start_ns, t.dns_end_ns), ("tcp", t.dns_end_ns or t.tcp_start_ns, t.tcp_end_ns), ("tls", t.tls_start_ns, t.tls_end_ns))
            for name, start, end in steps:
                if start is not None and end is not None:
                    tracer.start_span(name, context=conn_ctx, start_time=wall(start)).end(end_time=wall(end))
            conn.end(end_time=wall(connect_end))
        if t.tokenize_prompt_s is not None:
            start = t.issued_ns or t.received_ns
            span = tracer.start_span("tokenize", context=server_ctx, start_time=wall(start))
            span.set_attribute("gen_ai.usage.input_tokens", t.prompt_tokens or 0)
            span.end(end_time=wall(start + int(t.tokenize_prompt_s * 1e9)))
        if t.content_ns:
            first = t.content_ns[0]
            prefill_ns = int(b.phases.get("prefill", 0.0) * 1e9)
            if "queue" in b.phases:  # the engine reported its prefill: the rest waited
                queue_ns = int(b.phases["queue"] * 1e9)
                tracer.start_span("queue", context=server_ctx, start_time=wall(first - prefill_ns - queue_ns)).end(end_time=wall(first - prefill_ns))
            tracer.start_span("prefill", context=server_ctx, start_time=wall(first - prefill_ns)).end(end_time=wall(first))
            decode = tracer.start_span("decode", context=server_ctx, start_time=wall(first))
            if b.decode_tokens_per_second is not None:
                decode.set_attribute("llmproxy.decode_tokens_per_second", b.decode_tokens_per_second)
            self._chunks(decode, t, wall)
            decode.end(end_time=wall(t.upstream_end_ns or t.content_ns[-1]))
        upstream.end(end_time=wall(t.upstream_end_ns or end_ns))
        server.end(end_time=wall(end_ns))

    def _chunks(self, decode: Any, t: RequestTiming, wall: Callable[[int], int]) -> None:
        mode = self.settings.token_spans
        if mode == "off":
            return
        tokens = t.chunk_tokens or [1] * len(t.content_ns)
        ctx = trace.set_span_in_context(decode)
        previous = t.content_ns[0]
        for index, (instant, count) in enumerate(zip(t.content_ns, tokens)):
            attrs = {"llmproxy.chunk.index": index, "llmproxy.chunk.tokens": count}
            if mode == "events":
                decode.add_event("chunk", attrs, timestamp=wall(instant))
            else:
                self.tracer.start_span("chunk", context=ctx, start_time=wall(previous), attributes=attrs).end(end_time=wall(instant))
            previous = instant

    def _attributes(self, t: RequestTiming, b: Breakdown) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": OPERATIONS[t.endpoint],
            "gen_ai.provider.name": self.settings.provider,
            "gen_ai.request.model": t.model,
            "gen_ai.request.stream": t.stream,
            "server.address": self.host,
            "server.port": self.port,
            "http.response.status_code": t.status_code,
            "llmproxy.outcome": t.outcome,
            "llmproxy.duration_seconds": b.e2e_s,
            "llmproxy.tokens.source": t.token_source,
        }
        if t.response_model:
            attrs["gen_ai.response.model"] = t.response_model
        if t.prompt_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = t.prompt_tokens
        if t.completion_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = t.completion_tokens
        if b.ttft_s is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = b.ttft_s
        if b.decode_tokens_per_second is not None:
            attrs["llmproxy.decode_tokens_per_second"] = b.decode_tokens_per_second
        if t.reused is not None:
            attrs["llmproxy.connection.reused"] = t.reused
        if t.rtt_s is not None:
            attrs["llmproxy.upstream.rtt_seconds"] = t.rtt_s
        for phase, seconds in b.phases.items():
            attrs[f"llmproxy.phase.{phase}_seconds"] = seconds
        if t.captured_input:  # only with --capture-content
            attrs["gen_ai.input.messages"] = t.captured_input
        if t.captured_output:
            attrs["gen_ai.output.messages"] = t.captured_output
        if t.engine is not None:
            for key, value in t.engine.as_dict().items():
                if value is not None:
                    attrs[f"llmproxy.engine.{key}"] = value
        return attrs
