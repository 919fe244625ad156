"""OTLP span export, encoded and sent from the offload worker process instead of this one.

Why: the OTLP exporter builds its protobuf messages in Python, attribute by attribute, holding
the GIL the event loop needs; at 64 streams that encoding was half of tracing's cost
(bench/RESULTS.md). Here the batch processor's thread only flattens each finished span into plain
tuples (cheap to pickle); a background worker (nice 19) rebuilds them and runs the stock
`OTLPSpanExporter`, configured from the same settings and OTEL_EXPORTER_OTLP_* variables.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

if TYPE_CHECKING:
    from .offload import Offload

EXPORT_TIMEOUT_S = 30.0
Row = tuple[Any, ...]


def _context(ctx: SpanContext | None) -> tuple[int, int, bool, int, str] | None:
    if ctx is None:
        return None
    return ctx.trace_id, ctx.span_id, ctx.is_remote, int(ctx.trace_flags), ctx.trace_state.to_header()


def flatten(span: ReadableSpan) -> Row:
    """A finished span as plain values (in the batch processor's thread)."""
    status = span.status
    events = tuple((e.name, dict(e.attributes or {}), e.timestamp) for e in span.events)
    return (span.name, _context(span.context), _context(span.parent), span.kind.value, span.start_time, span.end_time,
            status.status_code.value, status.description, dict(span.attributes or {}), events)


def _span_context(values: tuple[int, int, bool, int, str] | None) -> SpanContext | None:
    if values is None:
        return None
    trace_id, span_id, remote, flags, state = values
    return SpanContext(trace_id, span_id, remote, TraceFlags(flags), TraceState.from_header([state]) if state else None)


def rebuild(row: Row, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The span again (in the worker), for the stock exporter."""
    name, context, parent, kind, start, end, status_code, description, attributes, events = row
    return ReadableSpan(name, _span_context(context), _span_context(parent), resource, attributes,
                        [Event(n, a, timestamp=ts) for n, a, ts in events], (), SpanKind(kind), None,
                        Status(StatusCode(status_code), description), start, end, scope)


_exporters: dict[str, SpanExporter] = {}  # in the worker process only: one OTLP exporter per endpoint


def export_rows(endpoint: str, resource: dict[str, Any], scope: tuple[str, str | None], rows: list[Row]) -> bool:
    """In the worker: encode and send one batch; True when the receiver accepted it."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = _exporters.get(endpoint)
    if exporter is None:
        exporter = _exporters[endpoint] = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    res, sc = Resource(resource), InstrumentationScope(scope[0], scope[1])
    return exporter.export([rebuild(row, res, sc) for row in rows]) is SpanExportResult.SUCCESS


class WorkerExporter(SpanExporter):
    """A SpanExporter for the batch processor that hands its batches to the offload worker."""

    def __init__(self, offload: Offload, endpoint: str) -> None:
        self.offload = offload
        self.endpoint = endpoint  # '' : the exporter reads OTEL_EXPORTER_OTLP_* itself (the worker inherits them)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        first = spans[0]
        scope = first.instrumentation_scope
        future = self.offload.submit_background(export_rows, self.endpoint, dict(first.resource.attributes),
                                     (scope.name, scope.version) if scope else ("llm-latency-proxy", None), [flatten(s) for s in spans])
        ok = future.result(timeout=EXPORT_TIMEOUT_S)  # waits without the GIL; the processor's thread only
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass  # the worker's exporters end with the worker (Offload.shutdown, after the provider's)
