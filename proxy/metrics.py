"""Prometheus metrics: each defined once in METRICS, observed once per finished request.

The table below is the contract that the README, the dashboards and the alert rules are checked
against. `ProxyMetrics` takes a registry (tests build a fresh one) and binds label children once
per label set, so observing a request does no label validation.
"""
from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder, generate_latest

from .timing import Breakdown, RequestTiming

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
)
GAP_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)
TPS_BUCKETS = (
    1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 75.0, 100.0, 125.0, 150.0, 200.0, 300.0,
    500.0, 750.0, 1000.0, 2000.0, 5000.0, 10000.0,
)
PREFILL_TPS_BUCKETS = TPS_BUCKETS + (20000.0, 50000.0, 100000.0)
TOKENIZE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)

BASE = ("model", "upstream", "endpoint", "stream")
# Telemetry components, initialised to 0 so dashboards and alerts see the series before any error.
COMPONENTS = ("metrics", "tracing", "tokenizer", "records", "timing", "otlp_export")


@dataclass(frozen=True)
class MetricDef:
    name: str  # without the _total suffix for counters (prometheus_client adds it)
    kind: str  # counter, gauge, histogram
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


METRICS: tuple[MetricDef, ...] = (
    MetricDef("llmproxy_requests", "counter", "Finished requests by outcome (ok, upstream_error, client_disconnect, client_slow, timeout, proxy_error) and HTTP status. The latency histograms below describe the ok ones.", BASE + ("outcome", "code")),
    MetricDef("llmproxy_requests_in_flight", "gauge", "Requests being relayed now.", ("upstream",)),
    MetricDef("llmproxy_request_duration_seconds", "histogram", "End to end: request received by the proxy to the last byte relayed (successful requests).", BASE, LATENCY_BUCKETS),
    MetricDef("llmproxy_time_to_first_token_seconds", "histogram", "First content chunk of any choice minus request received by the proxy (successful streaming requests).", BASE, LATENCY_BUCKETS),
    MetricDef("llmproxy_inter_token_latency_seconds", "histogram", "Per choice: gap between consecutive content chunks divided by the tokens in the later chunk.", BASE, GAP_BUCKETS),
    MetricDef("llmproxy_inter_chunk_latency_seconds", "histogram", "Per choice: gap between consecutive content chunks.", BASE, GAP_BUCKETS),
    MetricDef("llmproxy_decode_tokens_per_second", "histogram", "Per request: tokens streamed after each choice's first content chunk / that choice's decode window, averaged over choices; hidden reasoning tokens excluded.", BASE, TPS_BUCKETS),
    MetricDef("llmproxy_prefill_tokens_per_second", "histogram", "Per request: uncached prompt tokens / prefill phase seconds.", BASE, PREFILL_TPS_BUCKETS),
    MetricDef("llmproxy_phase_seconds", "histogram", "Seconds of each phase of a successful request (client, proxy, network, tokenize, queue, reasoning, prefill, decode, server); the phases sum to the request duration.", BASE + ("phase",), LATENCY_BUCKETS),
    MetricDef("llmproxy_engine_prefill_seconds", "histogram", "Reported by the engine (llama.cpp timings.prompt_ms, vLLM metrics.time_to_first_token_ms): its prompt processing time.", BASE, LATENCY_BUCKETS),
    MetricDef("llmproxy_engine_time_per_output_token_seconds", "histogram", "Reported by the engine (llama.cpp timings.predicted_per_token_ms, vLLM metrics.mean_itl_ms, TGI x-time-per-token): its decode time per output token.", BASE, GAP_BUCKETS),
    MetricDef("llmproxy_upstream_connect_seconds", "histogram", "Opening a new upstream connection, by step (dns, tcp, tls).", ("upstream", "step"), LATENCY_BUCKETS),
    MetricDef("llmproxy_upstream_rtt_seconds", "histogram", "Kernel smoothed RTT (TCP_INFO) of the upstream connection a request used.", ("upstream",), LATENCY_BUCKETS),
    MetricDef("llmproxy_tokenize_seconds", "histogram", "Tokenizer time per request, by kind (prompt, completion).", ("model", "kind"), TOKENIZE_BUCKETS),
    MetricDef("llmproxy_tokens", "counter", "Tokens by kind (prompt, completion, cached_prompt: prompt tokens served from the cache, reasoning: hidden reasoning tokens, part of completion) and source (usage, engine, tokenizer).", ("model", "upstream", "kind", "source")),
    MetricDef("llmproxy_upstream_connections", "counter", "Upstream requests by whether they reused a pooled connection.", ("upstream", "reused")),
    MetricDef("llmproxy_telemetry_errors", "counter", "Failures inside metrics, tracing, tokenizer or records; the request itself was unaffected.", ("component",)),
)


def observe_many(child: Any, values: list[float], bounds: tuple[float, ...]) -> None:
    """Observe a request's inter-token gaps (often hundreds) with one increment per bucket used.

    Equivalent to calling `observe` for each value, without a lock round-trip per value; falls
    back to that if prometheus_client's histogram child ever stops looking like 0.2x's.
    """
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    if buckets is None or total is None or len(buckets) != len(bounds) + 1 or len(values) < 8:
        for value in values:
            child.observe(value)
        return
    counts = [0] * len(buckets)
    for value in values:
        counts[bisect_left(bounds, value)] += 1
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)
    total.inc(sum(values))


class ModelLabels:
    """Caps the distinct `model` label values; later ones become `other`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, model: str) -> str:
        if model in self._seen:
            return model
        if len(self._seen) >= self.limit:
            return "other"
        self._seen.add(model)
        return model


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry, max_models: int = 100, multiprocess: bool = False) -> None:
        self.registry = registry
        self.multiprocess = multiprocess
        self.models = ModelLabels(max_models)
        self.m: dict[str, Any] = {}
        for d in METRICS:
            if d.kind == "counter":
                self.m[d.name] = Counter(d.name, d.doc, d.labels, registry=registry)
            elif d.kind == "gauge":
                self.m[d.name] = Gauge(d.name, d.doc, d.labels, registry=registry, multiprocess_mode="livesum")
            else:
                self.m[d.name] = Histogram(d.name, d.doc, d.labels, registry=registry, buckets=d.buckets)
        self._bound: dict[tuple[str, ...], dict[str, Any]] = {}
        for component in COMPONENTS:
            self.m["llmproxy_telemetry_errors"].labels(component)

    def _children(self, model: str, upstream: str, endpoint: str, stream: str) -> dict[str, Any]:
        key = (model, upstream, endpoint, stream)
        bound = self._bound.get(key)
        if bound is None:
            bound = {d.name: self.m[d.name].labels(*key) for d in METRICS if d.labels == BASE}
            bound["phase"] = {}
            self._bound[key] = bound
        return bound

    def in_flight(self, upstream: str) -> Any:
        return self.m["llmproxy_requests_in_flight"].labels(upstream)

    def telemetry_error(self, component: str) -> None:
        self.m["llmproxy_telemetry_errors"].labels(component).inc()

    def observe(self, t: RequestTiming, b: Breakdown | None, upstream: str, trace_id: str | None = None) -> None:
        """Everything about one finished request, in one place. The latency breakdown describes
        successful requests only: a 10 s connect timeout must not bend the split of the ok ones."""
        model = self.models(t.model)
        stream = "true" if t.stream else "false"
        m = self.m
        m["llmproxy_requests"].labels(model, upstream, t.endpoint, stream, t.outcome, str(t.status_code)).inc()
        for step, seconds in (b.connect.items() if b is not None else ()):
            m["llmproxy_upstream_connect_seconds"].labels(upstream, step).observe(seconds)
        if t.rtt_s is not None:
            m["llmproxy_upstream_rtt_seconds"].labels(upstream).observe(t.rtt_s)
        if t.reused is not None:
            m["llmproxy_upstream_connections"].labels(upstream, "true" if t.reused else "false").inc()
        if t.tokenize_prompt_s is not None:
            m["llmproxy_tokenize_seconds"].labels(model, "prompt").observe(t.tokenize_prompt_s)
        if t.tokenize_completion_s is not None:
            m["llmproxy_tokenize_seconds"].labels(model, "completion").observe(t.tokenize_completion_s)
        tokens = m["llmproxy_tokens"]
        for kind, count in (("prompt", t.prompt_tokens), ("completion", t.completion_tokens),
                            ("cached_prompt", t.cached_prompt_tokens), ("reasoning", t.hidden_reasoning_tokens)):
            if count:
                tokens.labels(model, upstream, kind, t.token_source).inc(count)
        if b is None or t.outcome != "ok":
            return
        c = self._children(model, upstream, t.endpoint, stream)
        ex = {"trace_id": trace_id} if trace_id and not self.multiprocess else None
        c["llmproxy_request_duration_seconds"].observe(b.e2e_s, ex)
        if b.ttft_s is not None:
            c["llmproxy_time_to_first_token_seconds"].observe(b.ttft_s, ex)
        if b.decode_tokens_per_second is not None:
            c["llmproxy_decode_tokens_per_second"].observe(b.decode_tokens_per_second, ex)
        if b.prefill_tokens_per_second is not None:
            c["llmproxy_prefill_tokens_per_second"].observe(b.prefill_tokens_per_second)
        observe_many(c["llmproxy_inter_chunk_latency_seconds"], b.inter_chunk_s, GAP_BUCKETS)
        observe_many(c["llmproxy_inter_token_latency_seconds"], b.inter_token_s, GAP_BUCKETS)
        engine = t.engine
        if engine is not None:
            if engine.prompt_s is not None:
                c["llmproxy_engine_prefill_seconds"].observe(engine.prompt_s)
            if engine.per_token_s is not None:
                c["llmproxy_engine_time_per_output_token_seconds"].observe(engine.per_token_s)
        phases = c["phase"]
        for phase, seconds in b.phases.items():
            child = phases.get(phase)
            if child is None:
                child = phases[phase] = m["llmproxy_phase_seconds"].labels(model, upstream, t.endpoint, stream, phase)
            child.observe(seconds)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition for GET /metrics (OpenMetrics with exemplars when asked for)."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8"
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
