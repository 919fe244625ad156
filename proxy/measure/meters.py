"""OpenTelemetry metrics over OTLP, for backends that take no Prometheus scrape (Datadog, Honeycomb,
New Relic, Grafana Cloud, an OpenTelemetry Collector): beside /metrics, never instead of it.

The names, units, attributes and bucket boundaries are the OpenTelemetry GenAI semantic conventions'
(`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`, `gen_ai.server.time_to_first_token`,
`gen_ai.server.time_per_output_token`; attributes `gen_ai.operation.name`, `gen_ai.provider.name`,
`gen_ai.request.model`, `gen_ai.response.model`, `gen_ai.token.type`, `server.address`,
`server.port`, `error.type`); the split the proxy adds is `llmproxy.*` instruments. Every value
comes from the same finished record and split as the Prometheus metrics.

Why not the SDK's MeterProvider: each `record` there cleans, sorts and hashes its attributes and
takes the view locks: 25 µs a data point, 320 µs for a request's dozen, on the event loop
(bench/RESULTS.md). Here a request's points are a bisect and a few additions on plain lists, keyed
by attribute tuples built once per request; a thread, every `OTEL_METRIC_EXPORT_INTERVAL` ms
(60,000 by default), turns the aggregates into the SDK's own `MetricsData` and hands it to the stock
OTLP/HTTP exporter (its variables honoured: endpoint, headers, compression, and the temporality
preference: cumulative, or delta as Datadog wants it). On when `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`
or `OTEL_EXPORTER_OTLP_ENDPOINT` (or `--otlp-endpoint`) is set, off with `OTEL_METRICS_EXPORTER=none`;
failed exports are counted (`llmproxy_telemetry_errors_total{component="otlp_metrics"}`). Model names
are the Prometheus labels' (capped at --max-models): a backend's cardinality stays bounded too.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .. import apis
from ..config import Settings
from .labels import served
from .slo import tpot_s
from .timing import Breakdown, RequestTiming, failover_shares
from .tracing import OPERATIONS

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricsData

    from .labels import ModelLabels
    from .slo import Verdict

log = logging.getLogger("llmproxy.meters")

# The conventions' advised explicit bucket boundaries; the proxy's own histograms get wide ones.
OPERATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
RATE_BUCKETS = (5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 300.0, 1000.0)  # tok/s, as llmproxy_decode_tokens_per_second's


@dataclass(frozen=True)
class InstrumentDef:
    name: str
    kind: str  # histogram or counter
    unit: str
    doc: str
    buckets: tuple[float, ...] = ()


INSTRUMENTS: tuple[InstrumentDef, ...] = (
    InstrumentDef("gen_ai.client.operation.duration", "histogram", "s", "GenAI operation duration, as the proxy's clients saw it: request received to the last byte relayed (failures too, with error.type).", OPERATION_BUCKETS),
    InstrumentDef("gen_ai.client.token.usage", "histogram", "{token}", "Tokens per request, by gen_ai.token.type (input, output).", TOKEN_BUCKETS),
    InstrumentDef("gen_ai.server.time_to_first_token", "histogram", "s", "Time to the first content chunk of a successful streamed response, less the time lost on attempts abandoned on other replicas (llmproxy.phase failover, theirs).", TTFT_BUCKETS),
    InstrumentDef("gen_ai.server.time_per_output_token", "histogram", "s", "Per successful streamed request: (duration - TTFT) / (visible output tokens per choice - 1).", TPOT_BUCKETS),
    InstrumentDef("llmproxy.phase.duration", "histogram", "s", "Seconds of each phase of a successful request, by llmproxy.phase (client, proxy, failover: with the server.address of the replica abandoned, wait: the proxy's own wait for its upstream pool, network, tokenize, queue, load, reasoning, prefill, decode, server); they sum to its duration.", PHASE_BUCKETS),
    InstrumentDef("llmproxy.decode.rate", "histogram", "{token}/s", "Per successful request: tokens streamed after each choice's first content chunk / its decode window, averaged over choices.", RATE_BUCKETS),
    InstrumentDef("llmproxy.slo.requests", "counter", "{request}", "Generation requests judged against their objective (--slo), by llmproxy.slo and llmproxy.slo.result (good, bad)."),
    InstrumentDef("llmproxy.slo.misses", "counter", "{request}", "Bad requests by llmproxy.slo.objective (ttft, tpot, e2e, error) and llmproxy.slo.blame (the phase, or the outcome)."),
)
BY_NAME = {d.name: d for d in INSTRUMENTS}
Attributes = tuple[tuple[str, Any], ...]


def endpoint(settings: Settings) -> str | None:
    """Where metrics go, or None (off): the standard variables, else --otlp-endpoint."""
    if os.environ.get("OTEL_METRICS_EXPORTER", "otlp").strip().lower() == "none":
        return None
    explicit = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if explicit:
        return explicit
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or settings.otlp_endpoint
    return base.rstrip("/") + "/v1/metrics" if base else None


class Meters:
    """The aggregates (one list per instrument and attribute set), one request's observations, and
    the thread that exports them. `export` runs on the finisher; `collect` on the export thread."""

    name = "otlp_metrics"  # (the telemetry sink's component)

    def __init__(self, settings: Settings, models: ModelLabels, exporter: MetricExporter | None = None,
                 on_error: Callable[[str], None] = lambda component: None, interval_s: float | None = None) -> None:
        self.settings, self.models, self.on_error = settings, models, on_error
        self.tenant_label: Callable[[str], str] = lambda tenant: tenant  # the app sets its Tenants.label (as the Prometheus labels')
        self.exporter = exporter
        # histogram: [count, sum, min, max, bucket counts...]; counter: [value]
        self._points: dict[tuple[str, Attributes], list[Any]] = {}
        self._lock = threading.Lock()
        self._start_ns = self._last_ns = time.time_ns()
        self._stop = threading.Event()
        self.interval_s = interval_s if interval_s is not None else float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "60000")) / 1000
        self._thread: threading.Thread | None = None
        if exporter is not None:
            self._thread = threading.Thread(target=self._run, name="llmproxy-otlp-metrics", daemon=True)
            self._thread.start()

    def _histogram(self, name: str, value: float, attributes: Attributes) -> None:
        point = self._points.get((name, attributes))
        if point is None:
            bounds = BY_NAME[name].buckets
            point = self._points[(name, attributes)] = [0, 0.0, value, value] + [0] * (len(bounds) + 1)
        point[0] += 1
        point[1] += value
        if value < point[2]:
            point[2] = value
        if value > point[3]:
            point[3] = value
        point[4 + bisect_left(BY_NAME[name].buckets, value)] += 1

    def _add(self, name: str, amount: int, attributes: Attributes) -> None:
        point = self._points.get((name, attributes))
        if point is None:
            point = self._points[(name, attributes)] = [0]
        point[0] += amount

    def export(self, t: RequestTiming, b: Breakdown | None, upstream: str, server: tuple[str, int] | None, verdict: Verdict | None) -> None:
        """One finished request's points (the telemetry sink's call)."""
        operation = OPERATIONS[t.endpoint]
        if b is None or operation == "proxy":  # not a GenAI operation (a passthrough path)
            return
        host, port = server or self.settings.upstream_parts[1:3]
        model = self.models(t.model, served(t.status_code))
        common: Attributes = (("gen_ai.operation.name", operation), ("gen_ai.provider.name", apis.BY_NAME[t.api].provider or self.settings.provider),
                              ("gen_ai.request.model", model), ("server.address", host), ("server.port", port))
        if t.response_model:
            common += (("gen_ai.response.model", self.models(t.response_model, served(t.status_code))),)
        ok = t.outcome == "ok"
        if not ok:  # the class of error: the HTTP status when there is one, else the outcome
            common += (("error.type", str(t.status_code) if t.status_code >= 400 else t.outcome),)
        tenanted = common + (("llmproxy.tenant", self.tenant_label(t.tenant)),)
        with self._lock:
            self._histogram("gen_ai.client.operation.duration", b.e2e_s, tenanted)
            for kind, count in (("input", t.prompt_tokens), ("output", t.completion_tokens)):
                if count is not None:
                    self._histogram("gen_ai.client.token.usage", count, common + (("gen_ai.token.type", kind),))
            if verdict is not None and verdict.good is not None:
                judged: Attributes = (("llmproxy.slo", verdict.slo), ("gen_ai.request.model", model), tenanted[-1])
                self._add("llmproxy.slo.requests", 1, judged + (("llmproxy.slo.result", "good" if verdict.good else "bad"),))
                for objective, blamed in verdict.blame.items():
                    self._add("llmproxy.slo.misses", 1, judged + (("llmproxy.slo.objective", objective), ("llmproxy.slo.blame", blamed)))
            if not ok:
                return
            if b.ttft_s is not None:  # the serving replica's own: the abandoned replicas' time is theirs (below), as in metrics.py
                self._histogram("gen_ai.server.time_to_first_token", b.ttft_s - b.phases.get("failover", 0.0), tenanted)
                per_token = tpot_s(t, b)
                if per_token is not None:
                    self._histogram("gen_ai.server.time_per_output_token", per_token, common)
            if b.decode_tokens_per_second is not None:
                self._histogram("llmproxy.decode.rate", b.decode_tokens_per_second, tenanted)
            for phase, seconds in b.phases.items():
                if phase != "failover":
                    self._histogram("llmproxy.phase.duration", max(0.0, seconds), common + (("llmproxy.phase", phase),))
            for attempt, part in failover_shares(t, b):
                abandoned = tuple((k, attempt.host if k == "server.address" else attempt.port if k == "server.port" else v) for k, v in common)
                self._histogram("llmproxy.phase.duration", part, abandoned + (("llmproxy.phase", "failover"),))

    def collect(self, delta: bool = False) -> MetricsData:
        """The aggregates as the SDK's MetricsData, what the OTLP exporter encodes. `delta`: what
        came since the last collect, which then starts afresh (else cumulative since start)."""
        from opentelemetry.sdk.metrics.export import (AggregationTemporality, Histogram, HistogramDataPoint, Metric, MetricsData,
                                                      NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        with self._lock:
            points = self._points
            self._points = {} if delta else {key: list(value) for key, value in points.items()}
        now = time.time_ns()
        start = self._last_ns if delta else self._start_ns
        self._last_ns = now
        temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
        by_name: dict[str, list[Any]] = {}
        for (name, attributes), point in sorted(points.items(), key=lambda item: item[0][0]):
            d = BY_NAME[name]
            if d.kind == "counter":
                by_name.setdefault(name, []).append(NumberDataPoint(dict(attributes), start, now, point[0]))
            else:
                by_name.setdefault(name, []).append(HistogramDataPoint(dict(attributes), start, now, point[0], point[1], point[4:], d.buckets,
                                                                       point[2], point[3]))
        metrics = []
        for name, data_points in by_name.items():
            d = BY_NAME[name]
            data: Any = (Sum(data_points, temporality, is_monotonic=True) if d.kind == "counter" else Histogram(data_points, temporality))
            metrics.append(Metric(name, d.doc, d.unit, data))
        service = self.settings.service_name or os.environ.get("OTEL_SERVICE_NAME") or "llm-latency-proxy"
        resource = Resource.create({"service.name": service, "service.instance.id": self.settings.instance_name, "process.pid": os.getpid()})
        return MetricsData([ResourceMetrics(resource, [ScopeMetrics(InstrumentationScope("llm-latency-proxy"), metrics, "")], "")])

    def _send(self) -> None:
        exporter = self.exporter
        assert exporter is not None
        from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
        from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExportResult

        delta = (exporter._preferred_temporality or {}).get(HistogramInstrument) is AggregationTemporality.DELTA
        try:
            result = exporter.export(self.collect(delta), timeout_millis=10_000)
        except Exception:  # noqa: BLE001 - the thread must survive; the failure is counted
            log.debug("OTLP metrics export failed", exc_info=True)
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self.on_error("otlp_metrics")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._send()

    def shutdown(self) -> None:
        """A last export of what was recorded since the previous one, then the exporter's own shutdown."""
        if self._thread is None or self.exporter is None:
            return
        self._stop.set()
        self._thread.join(5)
        self._send()
        self.exporter.shutdown()


def build_meters(settings: Settings, models: ModelLabels, on_error: Callable[[str], None]) -> Meters | None:
    """Meters exporting over OTLP/HTTP when an endpoint is configured, else None (off)."""
    where = endpoint(settings)
    if where is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return Meters(settings, models, OTLPMetricExporter(endpoint=where), on_error)
