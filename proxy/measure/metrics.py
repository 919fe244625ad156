"""Prometheus metrics: each defined once in METRICS, observed once per finished request.

The table below is the contract that the reference (docs/metrics.md), the dashboards and the alert rules are checked
against. `ProxyMetrics` takes a registry (tests build a fresh one) and binds label children once
per label set, so observing a request does no label validation.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, disable_created_metrics
from prometheus_client.exposition import choose_encoder, generate_latest

from . import cpu
from .buckets import DURATION_BUCKETS, GAP_BUCKETS, LAG_BUCKETS, OVERHEAD_BUCKETS, PREFILL_TPS_BUCKETS, RTT_BUCKETS, TPS_BUCKETS, TTFT_BUCKETS, WAIT_BUCKETS
from .labels import ModelLabels, served
from .series import Series, observe_many
from .slo import BEFORE_FIRST_TOKEN, FAILED, Verdict
from .timing import PHASES, Breakdown, RequestTiming, failover_shares

BASE = ("model", "upstream", "endpoint", "stream")
# The families that tell callers apart (a tenant the --tenants file names, `unknown` or `other`): the
# request counter, the user-facing latency histograms and the SLO counters. Never the end user.
TENANTED = BASE + ("tenant",)
# Telemetry components, initialised to 0 so dashboards and alerts see the series before any error.
COMPONENTS = ("metrics", "tracing", "tokenizer", "records", "timing", "slo", "otlp_export", "otlp_metrics")
# Why a record never reached the store (records/: the serving process's queue and the writer process).
DROP_REASONS = ("buffer_full", "rejected", "shutdown", "clock_skew")
# The records store's maintenance, step by step (records backends' `step`): what llmproxy_records_maintenance_errors_total names.
MAINTENANCE_STEPS = ("connect", "boots", "partitions", "retention", "compaction", "migration")
# Why the proxy itself answered 503 proxy_overloaded (errors.EXHAUSTED holds the exhaustion ones).
REJECT_REASONS = ("max_in_flight", "queue_timeout", "pool", "descriptors", "ports", "memory")
# Why a relayed response was not (wholly) measured (timing.Unmeasured).
UNMEASURED_REASONS = ("event_too_large", "undecodable", "client_backpressure")
# What each objective's misses can be blamed on (slo.py): their series start at 0, so a burn's first
# miss is in rate(). (slo, model, upstream) sets beyond SLO_SETS fold into model="other": at most
# SLO_SETS x (2 + 8 + 1 + 10 + 4) = 1,600 series, inside the scrape budget at every cap.
BLAMES = {"ttft": BEFORE_FIRST_TOKEN, "tpot": ("decode",), "e2e": PHASES, "error": FAILED}
SLO_SETS = 64


@dataclass(frozen=True)
class MetricDef:
    name: str  # without the _total suffix for counters (prometheus_client adds it)
    kind: str  # counter, gauge, histogram, summary (sum and count only)
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    kernel: bool = False  # read from the kernel at each scrape (cpu.py), never observed here

    @property
    def exposed(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


METRICS: tuple[MetricDef, ...] = (
    MetricDef("llmproxy_requests", "counter", "Finished requests by tenant (one the --tenants file names, unknown: none attributed, other: the rest), wire API (openai, azure, anthropic, gemini, ollama, other), outcome (ok, upstream_error, client_disconnect, client_slow, timeout, proxy_error, overloaded) and HTTP status. The latency metrics below describe the ok ones.", TENANTED + ("api", "outcome", "code")),
    MetricDef("llmproxy_unmeasured_requests", "counter", "Requests relayed whole but not (wholly) measured, by reason: event_too_large (a streamed event past --max-event-bytes), undecodable (a content-encoding the proxy could not decode), client_backpressure (a slow client filled the stream's read-ahead, --stream-buffer-bytes, so reading paused: its decode figures would be the client's pace and are left out of the decode histograms).", ("upstream", "reason")),
    MetricDef("llmproxy_requests_in_flight", "gauge", "Requests being relayed now.", ("upstream",)),
    MetricDef("llmproxy_max_in_flight", "gauge", "The admission cap, --max-in-flight, summed over worker processes (0: no cap).", ("upstream",)),
    MetricDef("llmproxy_requests_rejected", "counter", "Requests the proxy answered 503 proxy_overloaded itself, by tenant and reason: max_in_flight (admission control: at the cap, its tenant at or over its share), queue_timeout (it waited --admission-queue-s for a slot), pool (every connection of the upstream's pool in use: --max-connections, --pool-timeout), descriptors, ports, memory (the proxy ran out while connecting upstream or relaying). Never the upstream's fault.", ("upstream", "reason", "tenant")),
    MetricDef("llmproxy_admission_in_flight", "gauge", "Requests admitted under --max-in-flight and in flight now, by tenant: each tenant's use of the cap (its share: its weight over the weights of the tenants in flight or waiting).", ("tenant",)),
    MetricDef("llmproxy_admission_queued", "gauge", "Requests waiting for a slot under --max-in-flight now (--admission-queue-s), by tenant.", ("tenant",)),
    MetricDef("llmproxy_admission_wait_seconds", "histogram", "How long each request waited for a slot under --max-in-flight (--admission-queue-s), admitted or not, by tenant: the proxy's own wait (the phase wait).", ("tenant",), WAIT_BUCKETS),
    MetricDef("llmproxy_read_ahead_bytes", "gauge", "Bytes of streamed responses read from upstreams ahead of slow clients now (per stream at most --stream-buffer-bytes, in all --stream-buffer-total-bytes; read at each scrape; with workers, each worker's every second).", ()),
    MetricDef("llmproxy_open_fds", "gauge", "Open file descriptors of the proxy's processes (read at each scrape; with workers, each worker's every second).", ()),
    MetricDef("llmproxy_max_fds", "gauge", "The open files limit (RLIMIT_NOFILE soft limit, after the proxy raised it to the hard one), summed over worker processes.", ()),
    MetricDef("llmproxy_process_cpu_periods", "counter", "CPU limit enforcement periods of the cgroup the proxy runs in (a container: the pod's; cpu.stat nr_periods; read at each scrape): with a CPU quota, one per period (100 ms by default) its processes ran in. No series without a cgroup.", (), kernel=True),
    MetricDef("llmproxy_process_cpu_throttled_periods", "counter", "Of those periods, the ones in which the cgroup spent its quota and every process of it (the serving process, the records writer, the tokenizer worker) was stopped until the next (cpu.stat nr_throttled). throttled / all is the share of periods throttled.", (), kernel=True),
    MetricDef("llmproxy_process_cpu_throttled_seconds", "counter", "Time the cgroup's processes were stopped for its CPU quota (cpu.stat throttled_time, v1, or throttled_usec, v2): the proxy's own delay, on every stream at once (the phase lag of their records).", (), kernel=True),
    MetricDef("llmproxy_process_cpu_limit_cores", "gauge", "The cgroup's CPU quota in cores (quota / period; no series without one).", (), kernel=True),
    MetricDef("llmproxy_event_loop_lag_seconds", "histogram", "How late each process's event loop ran a timer set every 500 ms on average while requests are in flight (at random: a fixed period would lock onto a CPU quota's): what every stream on it waited for it (a CPU quota, a burst, a GC pause, a noisy neighbour). A request's own share is its phase lag.", (), LAG_BUCKETS),
    MetricDef("llmproxy_accept_pauses", "counter", "Times the listener stopped accepting for 50 ms because the process was out of descriptors (or memory); clients waited in the listen backlog.", ("reason",)),
    MetricDef("llmproxy_request_duration_seconds", "histogram", "End to end: request received by the proxy to the last byte relayed (successful requests), by tenant too.", TENANTED, DURATION_BUCKETS),
    MetricDef("llmproxy_time_to_first_token_seconds", "histogram", "First content chunk of any choice minus request received by the proxy (successful streaming requests), by tenant too; less the time lost on attempts abandoned on other replicas (the phase failover, theirs): the upstream that served it is charged its own TTFT.", TENANTED, TTFT_BUCKETS),
    MetricDef("llmproxy_inter_token_latency_seconds", "histogram", "Per choice: gap between consecutive content chunks divided by the tokens in the later chunk.", BASE, GAP_BUCKETS),
    MetricDef("llmproxy_inter_chunk_latency_seconds", "summary", "Per choice: gap between consecutive content chunks (mean from sum / count).", BASE),
    MetricDef("llmproxy_decode_tokens_per_second", "histogram", "Per request: tokens streamed after each choice's first content chunk / that choice's decode window, averaged over choices; hidden reasoning tokens excluded; by tenant too.", TENANTED, TPS_BUCKETS),
    MetricDef("llmproxy_prefill_tokens_per_second", "histogram", "Per request: uncached prompt tokens / prefill phase seconds.", BASE, PREFILL_TPS_BUCKETS),
    MetricDef("llmproxy_phase_seconds", "counter", "Seconds spent in each phase of successful requests (client, proxy, wait: the proxy's own wait for its upstream pool, network, tokenize, queue, load, reasoning, prefill, decode, server); the phases sum to the request duration, so per phase / llmproxy_request_duration_seconds_sum is the split.", BASE + ("phase",)),
    MetricDef("llmproxy_proxy_overhead_seconds", "histogram", "Per successful request: the proxy's own time (the phase proxy), for its quantiles; not by model (it does not depend on one).", ("upstream", "endpoint", "stream"), OVERHEAD_BUCKETS),
    MetricDef("llmproxy_engine_prefill_seconds", "summary", "Reported by the engine (llama.cpp timings.prompt_ms, vLLM metrics.time_to_first_token_ms, Ollama prompt_eval_duration): its prompt processing time.", BASE),
    MetricDef("llmproxy_engine_time_per_output_token_seconds", "summary", "Reported by the engine (llama.cpp timings.predicted_per_token_ms, vLLM metrics.mean_itl_ms, TGI x-time-per-token, Ollama eval_duration / eval_count): its decode time per output token.", BASE),
    MetricDef("llmproxy_upstream_connect_seconds", "summary", "Opening a new upstream connection, by step (dns, tcp, tls).", ("upstream", "step")),
    MetricDef("llmproxy_upstream_rtt_seconds", "histogram", "Kernel smoothed RTT (TCP_INFO) of the upstream connection a request used.", ("upstream",), RTT_BUCKETS),
    MetricDef("llmproxy_tokenize_seconds", "summary", "Tokenizer time per request, by kind (prompt, completion).", ("model", "kind")),
    MetricDef("llmproxy_token_cache_lookups", "counter", "Prompt parts (a message, the tools, the instructions) looked up in the proxy's token-count cache, by result (hit: counted before, not tokenized again; miss: tokenized). hit / all is the hit ratio.", ("result",)),
    MetricDef("llmproxy_token_cache_bytes", "gauge", "Bytes of prompt text whose token counts the cache holds (at most 64 MiB per process).", ()),
    MetricDef("llmproxy_tokens", "counter", "Tokens by kind (prompt, completion, cached_prompt: prompt tokens served from the cache, reasoning: hidden reasoning tokens, part of completion) and source (usage, engine, tokenizer).", ("model", "upstream", "kind", "source")),
    MetricDef("llmproxy_prefix_predicted_tokens", "counter", "Prompt tokens the replica's prefix index predicted it had cached (pick: predicted_ttft; the prompts sent to it, prefix.py), on the requests whose engine reported its cached tokens; beside llmproxy_prefix_reported_tokens_total: how right the index is.", ("upstream",)),
    MetricDef("llmproxy_prefix_reported_tokens", "counter", "Prompt tokens the engine reported cached (prompt_tokens_details.cached_tokens, cache_read_input_tokens, llama.cpp's cache_n) on the requests its prefix index made a prediction for: what llmproxy_prefix_predicted_tokens_total is checked against.", ("upstream",)),
    MetricDef("llmproxy_prefix_strays", "counter", "Turns of a conversation this proxy had not seen on their replica (another proxy's, or from before a restart) that the engine then reported none of cached: prefilled whole. The proxy looks for such a conversation on the two replicas its key ranks first (prefix.py, picker.py); a steady rate means proxies disagree on where conversations live (docs/deployment.md).", ("upstream",)),
    MetricDef("llmproxy_upstream_connections", "counter", "Upstream requests by whether they reused a pooled connection: true, false (a new one), stale (a pooled one the upstream closed as the request went out, not a byte of an answer on it: the request went again on a new one).", ("upstream", "reused")),
    MetricDef("llmproxy_upstream_pool_connections", "gauge", "Connections of the proxy's own pool to each upstream now, by state: in_use (lent to a request) or idle (kept for reuse); over llmproxy_upstream_pool_limit, how full the pool is (read at each scrape; with workers, each worker's every second).", ("upstream", "state")),
    MetricDef("llmproxy_upstream_pool_limit", "gauge", "The size of the proxy's pool per upstream, summed over worker processes: --max-connections, else --max-in-flight, else the streams the open files limit holds.", ("upstream",)),
    MetricDef("llmproxy_upstream_pool_waits", "counter", "Requests that found the upstream's pool full, by result: waited (they got a connection within --pool-timeout; that wait is the phase `wait`, the proxy's own) or refused (503 proxy_overloaded, reason pool). Any at all: the proxy's own pool is the bottleneck, not the network or the engine.", ("upstream", "result")),
    MetricDef("llmproxy_failovers", "counter", "Attempts abandoned for another replica of the route, by the replica abandoned and why: connect_error, broken (the connection failed before anything reached the client), status_5xx, status_429, deadline (no content token by the route's first_token_deadline). Their time is the phase failover; each request's attempts are in its record.", ("model", "upstream", "reason")),
    MetricDef("llmproxy_upstream_ejections", "counter", "Times each replica was set aside for failing, by reason: consecutive_failures, failure_share (of its attempts over the ejection window), retry_after (a 429 or 503 asked for quiet), probe_failed (its probe after an ejection failed too). Routes file `ejection:`.", ("upstream", "reason")),
    MetricDef("llmproxy_upstream_state", "gauge", "Each replica's health now, 1 for its state: serving, ejected (set aside; its time up, the next request is its probe) or probing (the probe in flight); read at each scrape.", ("upstream", "state")),
    MetricDef("llmproxy_upstream_predicted_ttft_seconds", "gauge", "Each replica's predicted server time to first token for a 1,000-token prompt sent now: its pending prompt work and its own recent requests' prefill fit (pick: predicted_ttft; read at each scrape). What an external endpoint picker could use too.", ("upstream",)),
    MetricDef("llmproxy_telemetry_errors", "counter", "Failures inside metrics, tracing, tokenizer, records, the SLO verdict or OTLP exports (otlp_export: spans, otlp_metrics: metrics); the request itself was unaffected.", ("component",)),
    MetricDef("llmproxy_records_written", "counter", "Per-request records written to the records store (--records-db).", ()),
    MetricDef("llmproxy_records_buffered", "gauge", "Per-request records waiting to be written to the records store now (the store is down or slow when it grows).", ()),
    MetricDef("llmproxy_records_dropped", "counter", "Per-request records that never reached the store, by reason: buffer_full (the store was down or slow past --records-buffer or --records-buffer-bytes: the oldest went), rejected (the store refused a batch for what it held), shutdown (not written within the flush deadline at SIGTERM), clock_skew (it ended outside the store's window: before its retention, or more than an hour after the writer's clock).", ("reason",)),
    MetricDef("llmproxy_records_nulled", "counter", "Figures of per-request records set to null because the store's typed column could not hold them (NaN, an infinity, a count below zero or past a bigint), by field; the records themselves were kept.", ("field",)),
    MetricDef("llmproxy_records_maintenance_errors", "counter", "Failed passes of the records store's maintenance, by the step that failed: connect (its own connection), boots (crash accounting), partitions (days made ahead), retention (days dropped past the age and row limits), compaction (the aggregates), migration (an older level's indexes, schema 1's records moved in). Requests and writes go on; the step is tried again at the next pass (every 5 s in PostgreSQL), and what it leaves undone grows meanwhile: a store that is not kept to its retention, aggregates behind.", ("step",)),
    MetricDef("llmproxy_records_lost", "counter", "Per-request records lost by a writer that stopped without writing or counting them (a kill -9, an OOM kill, a crash), as the store's boots show (each writer's numbered, written and dropped records): counted once, by the writer that finds the dead one's boot.", ()),
    MetricDef("llmproxy_slo_requests", "counter", "Generation requests judged against their service-level objective (--slo), by tenant and result: good (every stated objective met) or bad. Exact counts: the error ratio and burn rate are bad / all.", ("slo", "model", "upstream", "tenant", "result")),
    MetricDef("llmproxy_slo_misses", "counter", "Bad requests by tenant, the objective missed (ttft, tpot, e2e, error) and its blame: for ttft and e2e the phase furthest above its usual value for the model, for tpot decode, for error the outcome. A request that missed two objectives counts once in each.", ("slo", "model", "upstream", "tenant", "objective", "blame")),
    MetricDef("llmproxy_slo_target", "gauge", "Each objective's target from the --slo file: the share of its requests that must be good (the error budget is 1 - target).", ("slo",)),
)

TENANT_POSITION = {d.name: d.labels.index("tenant") for d in METRICS if "tenant" in d.labels}  # where each family's tenant label is
# Each family's leading labels that a request's label set (TENANTED) holds, as positions in it: how a Series (series.py) binds them.
LEADING = {d.name: tuple(TENANTED.index(label) for label in itertools.takewhile(TENANTED.__contains__, d.labels)) for d in METRICS}


class ProxyMetrics:
    """Children are created on first use, per label set: a label set that never observed a value
    (an engine-only summary for an upstream that reports no engine timings, TTFT for a
    non-streaming request) exposes no series."""

    def __init__(self, registry: CollectorRegistry, max_models: int = 100, multiprocess: bool = False, max_label_sets: int = 400,
                 tenant_expiry_s: float = 3600.0) -> None:
        # `_created` would add a series beside every counter, histogram and summary: nothing we
        # ship reads it, and Prometheus does not need it. prometheus_client keeps that switch
        # process-wide; the proxy owns its process.
        disable_created_metrics()
        self.registry = registry
        self.multiprocess = multiprocess
        self.models = ModelLabels(max_models, max_label_sets)
        self.slo_sets = ModelLabels(max_models, SLO_SETS)
        self.tenant_label: Callable[[str], str] = lambda tenant: tenant  # the app sets its Tenants.label
        self.tenant_expiry_s = tenant_expiry_s
        self._tenant_seen: dict[str, float] = {}  # tenant label -> its last request (monotonic s)
        self.m: dict[str, Any] = {}
        # The cgroup's figures: the kernel's counters, read when scraped (with workers, by the worker answering).
        self.cpu = cpu.CgroupCollector(cpu.find(), {d.name: d.doc for d in METRICS if d.kernel})
        registry.register(self.cpu)
        for d in METRICS:
            if d.kernel:
                continue
            if d.kind == "counter":
                self.m[d.name] = Counter(d.name, d.doc, d.labels, registry=registry)
            elif d.kind == "gauge":
                self.m[d.name] = Gauge(d.name, d.doc, d.labels, registry=registry, multiprocess_mode="livesum")
            elif d.kind == "summary":
                self.m[d.name] = Summary(d.name, d.doc, d.labels, registry=registry)
            else:
                self.m[d.name] = Histogram(d.name, d.doc, d.labels, registry=registry, buckets=d.buckets)
        self._bound: dict[tuple[str, ...], Any] = {}
        # A label set's children (series.py): at most one per label set, which ModelLabels bounds (max_label_sets and its reserve).
        self._series: dict[tuple[str, ...], Series] = {}
        for component in COMPONENTS:
            self.m["llmproxy_telemetry_errors"].labels(component)
        for reason in DROP_REASONS:
            self.child("llmproxy_records_dropped", reason)
        self.child("llmproxy_records_lost")
        for step in MAINTENANCE_STEPS:
            self.child("llmproxy_records_maintenance_errors", step)
        for result in ("hit", "miss"):
            self.child("llmproxy_token_cache_lookups", result)

    def child(self, name: str, *labels: str) -> Any:
        """The child for these label values, bound once (no label validation per observation)."""
        key = (name, *labels)
        bound = self._bound.get(key)
        if bound is None:
            metric = self.m[name]
            bound = self._bound[key] = metric.labels(*labels) if labels else metric
        return bound

    def in_flight(self, upstream: str) -> Any:
        return self.child("llmproxy_requests_in_flight", upstream)

    def telemetry_error(self, component: str) -> None:
        self.child("llmproxy_telemetry_errors", component).inc()

    def token_cache(self, hits: int, misses: int, size: int) -> None:
        if hits:
            self.child("llmproxy_token_cache_lookups", "hit").inc(hits)
        if misses:
            self.child("llmproxy_token_cache_lookups", "miss").inc(misses)
        self.child("llmproxy_token_cache_bytes").set(size)

    def records_dropped(self, reason: str, count: int) -> None:
        """(From the records writer's thread: prometheus_client's children take their own lock.)"""
        self.child("llmproxy_records_dropped", reason).inc(count)

    def observe(self, t: RequestTiming, b: Breakdown | None, upstream: str, trace_id: str | None = None) -> None:
        """Everything about one finished request, in one place. The latency breakdown describes
        successful requests only: a 10 s connect timeout must not bend the split of the ok ones."""
        model = self.models(t.model, served(t.status_code))
        stream = "true" if t.stream else "false"
        child = self.child
        tenant = self.tenant_label(t.tenant)
        self._tenant_seen[tenant] = time.monotonic()
        tenanted = self.models.label_set(model, upstream, t.endpoint, stream, tenant)
        series = self._series.get(tenanted)
        if series is None:
            series = self._series[tenanted] = Series(child, tenanted, not self.multiprocess, LEADING)
        series.observe("llmproxy_requests", t.api, t.outcome, str(t.status_code))(1)
        if t.unmeasured:
            child("llmproxy_unmeasured_requests", upstream, t.unmeasured).inc()
        if t.outcome == "overloaded":
            child("llmproxy_requests_rejected", upstream, t.error.rpartition(":")[2], tenant).inc()
        if t.queued_ns is not None and t.admitted_ns is not None:
            child("llmproxy_admission_wait_seconds", tenant).observe((t.admitted_ns - t.queued_ns) / 1e9)
        for attempt, part in failover_shares(t, b):
            child("llmproxy_failovers", model, attempt.upstream, attempt.reason).inc()
            if b is not None and t.outcome == "ok":  # (the phase failover: each abandoned replica's own part)
                child("llmproxy_phase_seconds", *self.models.label_set(model, attempt.upstream, t.endpoint, stream, tenant)[:4], "failover").inc(part)
        if t.pool_full:
            child("llmproxy_upstream_pool_waits", upstream, "refused" if t.error == "proxy_overloaded:pool" else "waited").inc()
        for step, seconds in (b.connect.items() if b is not None else ()):
            child("llmproxy_upstream_connect_seconds", upstream, step).observe(seconds)
        if t.rtt_s is not None:
            series.observe("llmproxy_upstream_rtt_seconds")(t.rtt_s)
        if t.reused is not None:
            series.observe("llmproxy_upstream_connections", "true" if t.reused else "stale" if t.stale else "false")(1)
        if t.tokenize_prompt_s is not None:
            child("llmproxy_tokenize_seconds", model, "prompt").observe(t.tokenize_prompt_s)
        if t.tokenize_completion_s is not None:
            child("llmproxy_tokenize_seconds", model, "completion").observe(t.tokenize_completion_s)
        for kind, count in (("prompt", t.prompt_tokens), ("completion", t.completion_tokens),
                            ("cached_prompt", t.cached_prompt_tokens), ("reasoning", t.hidden_reasoning_tokens)):
            if count:
                child("llmproxy_tokens", model, upstream, kind, t.token_source).inc(count)
        if t.prefix_predicted_tokens is not None:
            child("llmproxy_prefix_predicted_tokens", upstream).inc(t.prefix_predicted_tokens)
            child("llmproxy_prefix_reported_tokens", upstream).inc(t.cached_prompt_tokens or 0)
        if t.prefix_stray:
            child("llmproxy_prefix_strays", upstream).inc()
        if b is None or t.outcome != "ok":
            return
        # The user-facing latencies, each with the request's trace id as its exemplar when it has one (through the
        # library, which validates it); the serving replica's own TTFT (the phase failover is the abandoned replicas', above).
        ex = {"trace_id": trace_id} if trace_id and not self.multiprocess else None
        for name, value in (("llmproxy_request_duration_seconds", b.e2e_s),
                            ("llmproxy_time_to_first_token_seconds", None if b.ttft_s is None else b.ttft_s - b.phases.get("failover", 0.0)),
                            ("llmproxy_decode_tokens_per_second", None if t.unmeasured == "client_backpressure" else b.decode_tokens_per_second)):
            if value is not None:
                if ex is not None:
                    child(name, *tenanted).observe(value, ex)
                else:
                    series.observe(name)(value)
        if b.prefill_tokens_per_second is not None:
            series.observe("llmproxy_prefill_tokens_per_second")(b.prefill_tokens_per_second)
        if t.unmeasured != "client_backpressure":  # (its decode stamps may be the client's pace, not the engine's)
            if b.inter_chunk_s:
                observe_many(series.many("llmproxy_inter_chunk_latency_seconds"), b.inter_chunk_s)
            if b.inter_token_s:
                observe_many(series.many("llmproxy_inter_token_latency_seconds"), b.inter_token_s, GAP_BUCKETS)
        engine = t.engine
        if engine is not None:
            if engine.prompt_s is not None:
                series.observe("llmproxy_engine_prefill_seconds")(engine.prompt_s)
            if engine.per_token_s is not None:
                series.observe("llmproxy_engine_time_per_output_token_seconds")(engine.per_token_s)
        for phase, seconds in b.phases.items():
            if phase != "failover":
                series.observe("llmproxy_phase_seconds", phase)(max(0.0, seconds))
        series.observe("llmproxy_proxy_overhead_seconds")(b.phases.get("proxy", 0.0))

    def observe_slo(self, verdict: Verdict, model: str, upstream: str, tenant: str = "unknown", admit: bool = True) -> None:
        """A judged request: good or bad, and each miss with its blame. A (slo, model, upstream, tenant)
        set's first verdict creates its every series at 0 (each result, each stated objective's blames)."""
        if verdict.good is None:
            return
        key = (verdict.slo, *self.slo_sets.label_set(self.models(model, admit), upstream, self.tenant_label(tenant)))
        child = self.child
        if ("llmproxy_slo_requests", *key, "good") not in self._bound:
            child("llmproxy_slo_requests", *key, "good")
            child("llmproxy_slo_requests", *key, "bad")
            for objective in (*verdict.stated, "error"):
                for blame in BLAMES[objective]:
                    child("llmproxy_slo_misses", *key, objective, blame)
        child("llmproxy_slo_requests", *key, "good" if verdict.good else "bad").inc()
        for objective, blame in verdict.blame.items():
            child("llmproxy_slo_misses", *key, objective, blame).inc()

    def _remove(self, names: Container[str], gone: Callable[[tuple[str, ...]], bool]) -> None:
        """The bound children of these metrics whose key (name, *labels) is `gone`: their series leave the scrape."""
        for key in list(self._bound):
            if key[0] in names and gone(key):
                self.m[key[0]].remove(*key[1:])
                del self._bound[key]
                self._series.clear()  # (they may hold it: made again at their next request)

    def slo_targets(self, targets: dict[str, float]) -> None:
        """The objectives in force (start-up and each reload): a removed objective's gauge goes."""
        self._remove(("llmproxy_slo_target",), lambda key: key[1] not in targets)
        for slo, target in targets.items():
            self.child("llmproxy_slo_target", slo).set(target)

    def expire_tenants(self, now: float | None = None) -> list[str]:
        """Remove the series of every tenant with no request for --tenant-expiry seconds (a tenant that
        stopped sending, or left the file), and free its label sets; what was removed. (Not with
        workers: their values live in files each worker keeps.)"""
        if self.tenant_expiry_s <= 0 or self.multiprocess:
            return []
        now = time.monotonic() if now is None else now
        stale = {tenant for tenant, seen in self._tenant_seen.items() if now - seen > self.tenant_expiry_s}
        if not stale:
            return []
        self._remove(TENANT_POSITION, lambda key: key[1 + TENANT_POSITION[key[0]]] in stale)
        self.models.forget(stale)
        self.slo_sets.forget(stale)
        for tenant in stale:
            del self._tenant_seen[tenant]
        return sorted(stale)

    def admission(self, held: dict[str, int], queued: dict[str, int]) -> None:
        """Each tenant's admitted and waiting requests now; a tenant with none reads 0 (its series stays until it expires)."""
        for name, now in (("llmproxy_admission_in_flight", held), ("llmproxy_admission_queued", queued)):
            for key in [k for k in self._bound if k[0] == name and k[1] not in now]:
                self._bound[key].set(0)
            for tenant, n in now.items():
                self.child(name, tenant).set(n)

    def tenants_known(self, upstream: str, tenants: Iterable[str], capped: bool) -> None:
        """The refusal series of every tenant the file names (and `unknown`, `other`) start at 0, so the
        dashboard and LLMProxySaturated see a tenant's first refusal in rate(); with a cap, its admission series too."""
        for tenant in tenants:
            for reason in REJECT_REASONS:
                self.child("llmproxy_requests_rejected", upstream, reason, tenant)
            if capped:
                for name in ("llmproxy_admission_in_flight", "llmproxy_admission_queued", "llmproxy_admission_wait_seconds"):
                    self.child(name, tenant)

    def accept_paused(self, upstream: str) -> Any:
        """The listener's pause counter (acceptor.py). The overload series start at 0, so the
        dashboard and LLMProxySaturated see them before any overload."""
        for result in ("waited", "refused"):
            self.child("llmproxy_upstream_pool_waits", upstream, result)
        for reason in UNMEASURED_REASONS:
            self.child("llmproxy_unmeasured_requests", upstream, reason)
        for reason in ("descriptors", "memory"):
            self.child("llmproxy_accept_pauses", reason)
        return lambda reason: self.child("llmproxy_accept_pauses", reason).inc()

    def predictions(self, seconds: dict[str, float]) -> None:
        """Each replica's predicted TTFT now (forecast.py); a replica with none (or no longer routed) has no series."""
        self._remove(("llmproxy_upstream_predicted_ttft_seconds",), lambda key: key[1] not in seconds)
        for label, value in seconds.items():
            self.child("llmproxy_upstream_predicted_ttft_seconds", label).set(value)

    def health(self, states: dict[str, str], known: Iterable[str], reasons: Iterable[str]) -> None:
        """Each routed replica's state now (of the fleet's `known` states: fleet/health.py), its ejection counters (`reasons`)
        from 0; an unrouted one's go."""
        self._remove(("llmproxy_upstream_state", "llmproxy_upstream_ejections"), lambda key: key[1] not in states)
        for label, current in states.items():
            for state in known:
                self.child("llmproxy_upstream_state", label, state).set(1 if state == current else 0)
            for reason in reasons:
                self.child("llmproxy_upstream_ejections", label, reason)

    def pools(self, upstreams: dict[str, tuple[int, int, int]]) -> None:
        """Each upstream pool's (in use, idle, limit) now; the gauges of an upstream no longer routed go."""
        self._remove(("llmproxy_upstream_pool_connections", "llmproxy_upstream_pool_limit"), lambda key: key[1] not in upstreams)
        for label, (in_use, idle, limit) in upstreams.items():
            self.child("llmproxy_upstream_pool_connections", label, "in_use").set(in_use)
            self.child("llmproxy_upstream_pool_connections", label, "idle").set(idle)
            self.child("llmproxy_upstream_pool_limit", label).set(limit)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition for GET /metrics (OpenMetrics with exemplars when asked for)."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            registry.register(self.cpu)
            return generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8"
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
