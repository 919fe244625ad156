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

    def end(self) -> None:
        """End both spans now if still open (a fallback when building them failed)."""
        for span in (self.upstream, self.server):
            if span.is_recording():
                span.end()

    def traceparent(self) -> bytes:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.upstream))
        return carrier["traceparent"].encode()


class Tracing:
    def __init__(self, provider: TracerProvider | None, settings: Settings) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("llm-latency-proxy") if provider is not None else None
        self.settings = settings
        _, self.host, self.port, _ = settings.upstream_parts

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @property
    def tracer(self) -> trace.Tracer:
        """Only called with tracing enabled (the relay asks `enabled` first)."""
        assert self._tracer is not None
        return self._tracer

    def start(self, headers: dict[str, str], t: RequestTiming, wall_ns: int) -> RequestSpans:
        parent = _PROPAGATOR.extract(headers)
        server = self.tracer.start_span(f"{OPERATIONS[t.endpoint]} {t.model}", context=parent, kind=SpanKind.SERVER, start_time=wall_ns)
        ctx = trace.set_span_in_context(server)
        upstream = self.tracer.start_span("upstream.request", context=ctx, kind=SpanKind.CLIENT, start_time=wall_ns)
        return RequestSpans(server, upstream)

    def finish(self, spans: RequestSpans, t: RequestTiming, b: Breakdown | None, offset_ns: int) -> None:
        """Attributes and child spans from the record; ends both open spans (also when the split failed)."""
        wall = lambda ns: ns + offset_ns  # noqa: E731 - monotonic instant to epoch ns
        end_ns = t.response_end_ns or t.received_ns
        server, upstream = spans.server, spans.upstream
        try:
            server.update_name(f"{OPERATIONS[t.endpoint]} {t.model}")
            if t.outcome != "ok":
                server.set_status(Status(StatusCode.ERROR, t.outcome))
                server.set_attribute("error.type", t.error or t.outcome)
            upstream.set_attributes({"server.address": self.host, "server.port": self.port, "http.response.status_code": t.status_code})
            if b is not None:
                server.set_attributes(self._attributes(t, b))
                self._children(spans, t, b, wall)
        finally:
            upstream.end(end_time=wall(t.upstream_end_ns or end_ns))
            server.end(end_time=wall(end_ns))

    def _children(self, spans: RequestSpans, t: RequestTiming, b: Breakdown, wall: Callable[[int], int]) -> None:
        tracer = self.tracer
        server_ctx = trace.set_span_in_context(spans.server)
        up_ctx = trace.set_span_in_context(spans.upstream)
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
        # Server-side steps, laid back to back where they happen: ending at the first token
        # (streaming) or starting when the request was sent (non-streaming).
        order = ("tokenize", "queue", "reasoning", "prefill") if t.content_ns else ("tokenize", "queue", "prefill", "decode", "server")
        if t.content_ns:
            at = t.content_ns[0] - sum(int(b.phases.get(name, 0.0) * 1e9) for name in order)
        else:
            at = t.sent_ns or t.headers_ns or t.issued_ns or t.received_ns
        for name in order:
            if name not in b.phases or (name == "tokenize" and t.tokenize_prompt_s is None):
                continue
            end = at + int(b.phases[name] * 1e9)
            span = tracer.start_span(name, context=server_ctx, start_time=wall(at))
            if name == "tokenize":
                span.set_attributes({"gen_ai.usage.input_tokens": t.prompt_tokens or 0, "llmproxy.estimate": True,
                                     "llmproxy.description": "the proxy's tokenizer CPU time for this prompt, standing for the server's own tokenization"})
            elif name == "reasoning":
                span.set_attributes({"llmproxy.estimate": True, "llmproxy.reasoning.hidden_tokens": t.hidden_reasoning_tokens,
                                     "llmproxy.description": "hidden reasoning tokens / this request's measured decode rate"})
            span.end(end_time=wall(end))
            at = end
        if t.content_ns:
            first = t.content_ns[0]
            decode = tracer.start_span("decode", context=server_ctx, start_time=wall(first))
            if b.decode_tokens_per_second is not None:
                decode.set_attribute("llmproxy.decode_tokens_per_second", b.decode_tokens_per_second)
            self._chunks(decode, t, wall)
            decode.end(end_time=wall(t.upstream_end_ns or max(t.content_ns)))

    def _chunks(self, decode: Any, t: RequestTiming, wall: Callable[[int], int]) -> None:
        mode = self.settings.token_spans
        if mode == "off":
            return
        tokens = t.chunk_tokens or [1.0] * len(t.content_ns)
        choices = t.content_choice or [0] * len(t.content_ns)
        ctx = trace.set_span_in_context(decode)
        previous: dict[int, int] = {}
        for index, (instant, count, choice) in enumerate(zip(t.content_ns, tokens, choices)):
            attrs = {"llmproxy.chunk.index": index, "llmproxy.chunk.tokens": count, "llmproxy.chunk.choice": choice}
            if mode == "events":
                decode.add_event("chunk", attrs, timestamp=wall(instant))
            else:
                start = previous.get(choice, instant)
                self.tracer.start_span("chunk", context=ctx, start_time=wall(start), attributes=attrs).end(end_time=wall(instant))
            previous[choice] = instant

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
            "llmproxy.choices": b.choices,
        }
        if t.cached_prompt_tokens is not None:
            attrs["gen_ai.usage.cache_read.input_tokens"] = t.cached_prompt_tokens
        if t.reasoning_tokens is not None:
            attrs["llmproxy.usage.reasoning_tokens"] = t.reasoning_tokens
            attrs["llmproxy.usage.reasoning_hidden"] = t.hidden_reasoning_tokens > 0
        if "reasoning" in b.phases:
            attrs["llmproxy.phase.reasoning_estimated"] = True
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
