"""OTLP metrics aggregated in the proxy: the same buckets and sums as the OTel SDK's own, cumulative
or delta, without the SDK's cost per point (the export to a real receiver: test_otlp.py)."""
from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

from proxy.config import Settings
from proxy.measure.meters import TTFT_BUCKETS, Meters
from proxy.measure.labels import ModelLabels
from proxy.measure.timing import split

from test_timing import MS, streaming_record


def points(data, name):  # type: ignore[no-untyped-def]
    return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name for p in m.data.data_points]


def test_histograms_match_the_sdks_own_aggregation():
    meters = Meters(Settings(upstream="http://10.0.0.5:8000/v1"), ModelLabels(100))
    reader = InMemoryMetricReader()
    sdk = MeterProvider(metric_readers=[reader]).get_meter("t").create_histogram("ttft", explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
    for first_ms in (1, 5, 6, 100, 101, 9000, 20000):  # on a bound, just above it, past the last
        t = streaming_record()
        t.content_ns = [first_ms * MS, first_ms * MS + 10 * MS]
        t.upstream_end_ns = t.response_end_ns = first_ms * MS + 11 * MS
        b = split(t)
        meters.export(t, b, "u", None, None)
        sdk.record(b.ttft_s)
    (ours,) = points(meters.collect(), "gen_ai.server.time_to_first_token")
    (theirs,) = points(reader.get_metrics_data(), "ttft")
    assert list(ours.bucket_counts) == list(theirs.bucket_counts) and ours.count == theirs.count == 7
    assert abs(ours.sum - theirs.sum) < 1e-12 and (ours.min, ours.max) == (theirs.min, theirs.max)
    assert ours.attributes["gen_ai.request.model"] == "m" and ours.attributes["server.address"] == "10.0.0.5"


def test_delta_collects_only_what_is_new():
    meters = Meters(Settings(upstream="http://10.0.0.5:8000/v1"), ModelLabels(100))
    t = streaming_record()
    b = split(t)
    meters.export(t, b, "u", None, None)
    first = meters.collect(delta=True)
    assert points(first, "gen_ai.client.operation.duration")[0].count == 1
    assert next(m.data.aggregation_temporality for rm in first.resource_metrics for sm in rm.scope_metrics for m in sm.metrics) \
        is AggregationTemporality.DELTA
    assert not points(meters.collect(delta=True), "gen_ai.client.operation.duration")  # nothing new
    meters.export(t, b, "u", None, None)
    meters.export(t, b, "u", None, None)
    assert points(meters.collect(delta=True), "gen_ai.client.operation.duration")[0].count == 2
