"""Metrics from one finished request, read back from a fresh registry."""
import re

import pytest
from prometheus_client import CollectorRegistry

from proxy.metrics import METRICS, ModelLabels, ProxyMetrics
from proxy.timing import split

from test_timing import streaming_record

UP = "127.0.0.1:8000"


def observed():
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    t = streaming_record()
    t.status_code = 200
    metrics.observe(t, split(t), UP, trace_id="0af7651916cd43dd8448eb211c80319c")
    return registry, metrics


def test_request_counter_and_histograms():
    registry, _ = observed()
    base = {"model": "m", "upstream": UP, "endpoint": "chat", "stream": "true"}
    assert registry.get_sample_value("llmproxy_requests_total", {**base, "outcome": "ok", "code": "200"}) == 1
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_sum", base) == pytest.approx(0.210)
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_bucket", {**base, "le": "0.2"}) == 0
    assert registry.get_sample_value("llmproxy_time_to_first_token_seconds_bucket", {**base, "le": "0.3"}) == 1
    assert registry.get_sample_value("llmproxy_decode_tokens_per_second_sum", base) == pytest.approx(100.0)
    assert registry.get_sample_value("llmproxy_inter_token_latency_seconds_count", base) == 2
    assert registry.get_sample_value("llmproxy_phase_seconds_sum", {**base, "phase": "prefill"}) == pytest.approx(0.2)
    assert registry.get_sample_value("llmproxy_upstream_connect_seconds_count", {"upstream": UP, "step": "tls"}) == 1
    assert registry.get_sample_value("llmproxy_upstream_connections_total", {"upstream": UP, "reused": "false"}) == 1
    assert registry.get_sample_value("llmproxy_tokens_total", {"model": "m", "upstream": UP, "kind": "prompt", "source": "usage"}) == 1000
    assert registry.get_sample_value("llmproxy_tokenize_seconds_count", {"model": "m", "kind": "prompt"}) == 1


def test_buckets_resolve_sub_millisecond_and_reach_minutes():
    for d in METRICS:
        if d.name in ("llmproxy_request_duration_seconds", "llmproxy_phase_seconds"):
            assert d.buckets[0] <= 0.0001 and d.buckets[-1] >= 300
        if d.name == "llmproxy_decode_tokens_per_second":
            assert d.buckets[0] == 1 and d.buckets[-1] == 10000


def test_model_labels_are_capped():
    cap = ModelLabels(2)
    assert [cap(m) for m in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_openmetrics_exposition_carries_the_trace_id_exemplar():
    _, metrics = observed()
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert re.search(rb'llmproxy_time_to_first_token_seconds_bucket\{.*\} 1.0 # \{trace_id="0af7651916cd43dd8448eb211c80319c"\}', body)


def test_every_defined_metric_is_exposed_with_its_name():
    registry, metrics = observed()
    metrics.telemetry_error("tracing")
    metrics.in_flight(UP).inc()
    body, _ = metrics.render("text/plain")
    for d in METRICS:
        assert f"# TYPE {d.exposed} {d.kind}\n".encode() in body, d.name


def test_observe_many_equals_observing_one_by_one():
    from prometheus_client import Histogram

    from proxy.metrics import GAP_BUCKETS, observe_many

    values = [0.00001, 0.0001, 0.00025, 0.0009, 0.001, 0.0042, 0.02, 0.02, 0.3, 7.0, 0.005, 0.0075] * 5
    one, many = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h", "h", registry=one, buckets=GAP_BUCKETS)
    b = Histogram("h", "h", registry=many, buckets=GAP_BUCKETS)
    for value in values:
        a.observe(value)
    observe_many(b, values, GAP_BUCKETS)
    for bound in [*map(str, GAP_BUCKETS), "+Inf"]:
        assert one.get_sample_value("h_bucket", {"le": bound}) == many.get_sample_value("h_bucket", {"le": bound}), bound
    assert one.get_sample_value("h_sum") == pytest.approx(many.get_sample_value("h_sum"))
    assert one.get_sample_value("h_count") == many.get_sample_value("h_count") == len(values)
