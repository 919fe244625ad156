"""OpenTelemetry spans built from the timing record, with explicit start and end times.

When the request starts only ids are fixed, because two must exist early: the SERVER span's (its
parent is the app's incoming `traceparent`) and the CLIENT `upstream.request` span's (its context
goes upstream as `traceparent`, so vLLM's spans join the trace). Every span is built once, at
finish, from recorded instants: the hot loop never touches tracing.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import apis
from ..config import Settings
from .export import WorkerExporter
from .timing import Breakdown, RequestTiming

if TYPE_CHECKING:
    from .offload import Offload
    from .slo import Verdict

# gen_ai.operation.name per endpoint. The Responses API is `chat` with `openai.api.type=responses`,
# as the OpenAI semantic conventions map it (they define no `responses` operation).
OPERATIONS = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings", "responses": "chat",
              "responses_other": "proxy", "messages": "chat", "messages_other": "proxy", "generate_content": "generate_content",
              "gemini_other": "proxy", "ollama_chat": "chat", "ollama_generate": "text_completion", "ollama_embed": "embeddings",
              "ollama_other": "proxy", "other": "proxy"}
API_TYPES = {"chat": "chat_completions", "responses": "responses"}
_PROPAGATOR = TraceContextTextMapPropagator()
_SCOPE = InstrumentationScope("llm-latency-proxy")
_UNSET = Status(StatusCode.UNSET)


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


def build_tracer_provider(settings: Settings, on_error: Callable[[str], None], offload: Offload | None = None) -> TracerProvider | None:
    """A provider exporting OTLP/HTTP when an endpoint is configured, else None (tracing off). With
    an offload worker, batches are encoded and sent from it (export.py), off this process's GIL."""
    env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not (settings.otlp_endpoint or env_endpoint):
        return None
    endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces" if settings.otlp_endpoint else ""
    exporter: SpanExporter
    if offload is not None:
        exporter = WorkerExporter(offload, endpoint)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_*
    name = settings.service_name or os.environ.get("OTEL_SERVICE_NAME") or "llm-latency-proxy"
    provider = TracerProvider(resource=Resource.create({"service.name": name, "process.pid": os.getpid()}))
    # A deeper queue than the SDK's 2,048: at thousands of requests a second, a batch in flight
    # to the worker must not make the processor drop spans (OTEL_BSP_MAX_QUEUE_SIZE still wins).
    queue = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "16384"))
    provider.add_span_processor(BatchSpanProcessor(CountingExporter(exporter, on_error), max_queue_size=queue))
    return provider


class RequestSpans:
    """One request's trace ids, fixed when it starts (the upstream needs its `traceparent`)."""

    __slots__ = ("trace_id_int", "parent", "server_id", "upstream_id", "flags", "trace_state", "exported")

    def __init__(self, trace_id: int, parent: SpanContext | None, server_id: int, upstream_id: int, flags: TraceFlags,
                 trace_state: TraceState | None) -> None:
        self.trace_id_int, self.parent, self.server_id, self.upstream_id = trace_id, parent, server_id, upstream_id
        self.flags, self.trace_state = flags, trace_state
        self.exported = False

    @property
    def sampled(self) -> bool:
        return self.flags.sampled

    @property
    def trace_id(self) -> str:
        return format(self.trace_id_int, "032x")

    def traceparent(self) -> bytes:
        return f"00-{self.trace_id_int:032x}-{self.upstream_id:016x}-{int(self.flags):02x}".encode()


class Tracing:
    """Builds each request's spans once, when it finishes, as finished `ReadableSpan`s handed
    straight to the provider's span processors (the batch exporter, or a test's in-memory one).

    Why not `tracer.start_span` per span: each live SDK span takes a lock per attribute, runs the
    processors' `on_start` and copies itself into a ReadableSpan at `end`; for spans whose every
    instant is already known that cost about 50 µs a span, several per request, on the event loop
    (bench/RESULTS.md). The provider's sampler still decides, once per request, at its start.
    """

    def __init__(self, provider: TracerProvider | None, settings: Settings) -> None:
        self.provider = provider
        self.settings = settings
        _, self.host, self.port, _ = settings.upstream_parts
        self.started = 0  # sampled requests whose spans are owed to the processors
        self.exported = 0
        if provider is not None:
            self._ids = provider.id_generator
            self._sampler = provider.sampler
            self._resource = provider.resource
            # The SDK's one handle on its processors (a TracerProvider has no public getter).
            self._processor = provider._active_span_processor

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def new_span_id(self) -> int:
        """A span id (an abandoned attempt's replacement: the next attempt's `traceparent`)."""
        return self._ids.generate_span_id()

    def start(self, headers: dict[str, str], t: RequestTiming, wall_ns: int) -> RequestSpans:
        """Only called with tracing enabled. Ids and the sampling decision; no span objects yet."""
        context = _PROPAGATOR.extract(headers)
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = self._ids.generate_trace_id()
            random_id = self._ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random_id = parent.trace_flags.random_trace_id
        result = self._sampler.should_sample(context, trace_id, f"{OPERATIONS[t.endpoint]} {t.model}", SpanKind.SERVER)
        flags = TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT
        flags |= TraceFlags.RANDOM_TRACE_ID if random_id else 0
        spans = RequestSpans(trace_id, parent, self._ids.generate_span_id(), self._ids.generate_span_id(), TraceFlags(flags),
                             result.trace_state)
        if spans.sampled:
            self.started += 1
        return spans

    def finish(self, spans: RequestSpans, t: RequestTiming, b: Breakdown | None, offset_ns: int,
               server: tuple[str, int] | None = None, verdict: Verdict | None = None) -> None:
        """Every span of the request, from the record; the SERVER and CLIENT spans go out even when
        building the rest failed."""
        if not spans.sampled or spans.exported:
            return
        spans.exported = True
        host, port = server or (self.host, self.port)  # the upstream the router chose
        wall = lambda ns: ns + offset_ns  # noqa: E731 - monotonic instant to epoch ns
        end_ns = t.response_end_ns or t.received_ns
        out: list[ReadableSpan] = []
        server_attrs: dict[str, Any] = {}
        status = _UNSET
        try:
            if t.outcome != "ok":
                status = Status(StatusCode.ERROR, t.outcome)
                server_attrs["error.type"] = t.error or t.outcome
            if b is not None:
                server_attrs.update(self._attributes(t, b, host, port))
                if verdict is not None:
                    server_attrs.update({"llmproxy.slo": verdict.slo, "llmproxy.slo.good": verdict.good,
                                         "llmproxy.slo.missed": list(verdict.missed) or None,
                                         "llmproxy.slo.blame": [f"{k}={v}" for k, v in verdict.blame.items()] or None})
                self._children(out, spans, t, b, wall)
        finally:
            server_attrs["llmproxy.tenant"] = t.tenant  # who sent it (tenants.py); its end user as OpenTelemetry names one
            if t.user:
                server_attrs["user.id"] = t.user
            for attempt in t.attempts:  # each abandoned attempt: a CLIENT span of its own, as its traceparent said
                out.append(self._span(spans, "upstream.request", attempt.span_id, spans.server_id, wall(attempt.start_ns), wall(attempt.end_ns),
                                      {"server.address": attempt.host, "server.port": attempt.port, "llmproxy.upstream": attempt.upstream,
                                       "llmproxy.attempt.abandoned": attempt.reason}, kind=SpanKind.CLIENT,
                                      status=Status(StatusCode.ERROR, f"abandoned: {attempt.reason}")))
            upstream_attrs = {"server.address": host, "server.port": port, "http.response.status_code": t.status_code}
            out.append(self._span(spans, "upstream.request", spans.upstream_id, spans.server_id, wall(t.received_ns),
                                  wall(t.upstream_end_ns or end_ns), upstream_attrs, kind=SpanKind.CLIENT))
            out.append(self._span(spans, f"{OPERATIONS[t.endpoint]} {t.model}", spans.server_id, None, wall(t.received_ns),
                                  wall(end_ns), server_attrs, kind=SpanKind.SERVER, status=status))
            for span in out:
                self._processor.on_end(span)
            self.exported += 1

    def _span(self, spans: RequestSpans, name: str, span_id: int, parent_id: int | None, start: int, end: int,
              attributes: dict[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL, status: Status = _UNSET,
              events: Sequence[Event] = ()) -> ReadableSpan:
        trace_id = spans.trace_id_int
        if parent_id is not None:
            parent: SpanContext | None = SpanContext(trace_id, parent_id, False, spans.flags, spans.trace_state)
        else:
            parent = spans.parent  # the app's own span (remote), or none: a root
        return ReadableSpan(
            name, SpanContext(trace_id, span_id, False, spans.flags, spans.trace_state), parent, self._resource,
            {k: v for k, v in attributes.items() if v is not None} if attributes else {}, events, (), kind, None, status,
            start, end, _SCOPE)

    def _children(self, out: list[ReadableSpan], spans: RequestSpans, t: RequestTiming, b: Breakdown, wall: Callable[[int], int]) -> None:
        new_id = self._ids.generate_span_id
        server_id = spans.server_id
        if t.tcp_start_ns is not None:
            connect_start = t.dns_start_ns or t.tcp_start_ns
            connect_end = t.tls_end_ns or t.tcp_end_ns or connect_start
            conn_id = new_id()
            steps = (("dns", t.dns_start_ns, t.dns_end_ns), ("tcp", t.dns_end_ns or t.tcp_start_ns, t.tcp_end_ns),
                     ("proxy", t.proxy_start_ns, t.proxy_end_ns), ("tls", t.tls_start_ns, t.tls_end_ns))
            for name, start, end in steps:
                if start is not None and end is not None:
                    out.append(self._span(spans, name, new_id(), conn_id, wall(start), wall(end)))
            out.append(self._span(spans, "upstream.connect", conn_id, spans.upstream_id, wall(connect_start), wall(connect_end)))
        if t.pool_full and t.issued_ns is not None and t.first_event_ns is not None:  # the proxy's own queue, named as such
            out.append(self._span(spans, "proxy.wait", new_id(), spans.upstream_id, wall(t.issued_ns), wall(t.first_event_ns),
                                  {"llmproxy.description": "waiting for a free connection of the proxy's own upstream pool (--max-connections)"}))
        # Server-side steps, laid back to back where they happen: ending at the first token
        # (streaming) or starting when the request was sent (non-streaming).
        order = ("tokenize", "queue", "reasoning", "prefill") if t.content_ns else ("tokenize", "queue", "prefill", "decode", "server")
        first = t.content_ns[0] - int(b.inferred_s * 1e9) if t.content_ns else 0  # (a first token read with later ones: reads.py)
        if t.content_ns:
            at = first - sum(int(b.phases.get(name, 0.0) * 1e9) for name in order)
        else:
            at = t.sent_ns or t.headers_ns or t.issued_ns or t.received_ns
        for name in order:
            if name not in b.phases or (name == "tokenize" and t.tokenize_prompt_s is None):
                continue
            end = at + int(b.phases[name] * 1e9)
            attrs: dict[str, Any] | None = None
            if name == "tokenize":
                attrs = {"gen_ai.usage.input_tokens": t.prompt_tokens or 0, "llmproxy.estimate": True,
                         "llmproxy.description": "the proxy's tokenizer CPU time for this prompt, standing for the server's own tokenization"}
            elif name == "reasoning":
                attrs = {"llmproxy.estimate": True, "llmproxy.reasoning.hidden_tokens": t.hidden_reasoning_tokens,
                         "llmproxy.description": "hidden reasoning tokens / this request's measured decode rate"}
            out.append(self._span(spans, name, new_id(), server_id, wall(at), wall(end), attrs))
            at = end
        if t.content_ns:
            decode_id = new_id()
            attrs = {"llmproxy.decode_tokens_per_second": b.decode_tokens_per_second}
            events = self._chunks(out, spans, decode_id, t, wall, attrs)
            out.append(self._span(spans, "decode", decode_id, server_id, wall(first), wall(t.upstream_end_ns or max(t.content_ns)),
                                  attrs, events=events))

    def _chunks(self, out: list[ReadableSpan], spans: RequestSpans, decode_id: int, t: RequestTiming,
                wall: Callable[[int], int], attrs: dict[str, Any]) -> list[Event]:
        """Per-token stamps (--token-spans). `offsets` (the default): three arrays on the decode span,
        one entry per content chunk: its arrival in µs after the decode span's start (the first
        chunk), its tokens, its choice. `events`: one span event per chunk; `spans`: one span each."""
        mode = self.settings.token_spans
        if mode == "off":
            return []
        if mode == "offsets":
            first = t.content_ns[0]
            attrs["llmproxy.chunk.offsets_us"] = [(instant - first) // 1000 for instant in t.content_ns]
            if t.chunk_tokens is not None:
                attrs["llmproxy.chunk.tokens"] = [round(count, 3) for count in t.chunk_tokens]
            if any(t.content_choice):  # n > 1
                attrs["llmproxy.chunk.choices"] = list(t.content_choice)
            return []
        tokens = t.chunk_tokens or [1.0] * len(t.content_ns)
        choices = t.content_choice or [0] * len(t.content_ns)
        events: list[Event] = []
        previous: dict[int, int] = {}
        for index, (instant, count, choice) in enumerate(zip(t.content_ns, tokens, choices)):
            attrs = {"llmproxy.chunk.index": index, "llmproxy.chunk.tokens": count, "llmproxy.chunk.choice": choice}
            if mode == "events":
                events.append(Event("chunk", attrs, timestamp=wall(instant)))
            else:
                start = previous.get(choice, instant)
                out.append(self._span(spans, "chunk", self._ids.generate_span_id(), decode_id, wall(start), wall(instant), attrs))
            previous[choice] = instant
        return events

    def _attributes(self, t: RequestTiming, b: Breakdown, host: str, port: int) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": OPERATIONS[t.endpoint],
            "openai.api.type": API_TYPES.get(t.endpoint) if t.api in ("openai", "azure") else None,
            "gen_ai.provider.name": apis.BY_NAME[t.api].provider or self.settings.provider,
            "llmproxy.api": t.api,
            "gen_ai.request.model": t.model,
            "gen_ai.request.stream": t.stream,
            "server.address": host,
            "server.port": port,
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
        if b.client_blocked_s:
            attrs["llmproxy.client_blocked_seconds"] = b.client_blocked_s
        if t.unmeasured:
            attrs["llmproxy.unmeasured"] = t.unmeasured
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
