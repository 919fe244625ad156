"""A request's children observed directly (series.py): what the scrape reads is what prometheus_client's own calls make."""
from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, Summary

from proxy.measure.buckets import GAP_BUCKETS, TTFT_BUCKETS
from proxy.measure.series import Cell, increment, observe_many, observer

VALUES = [0.0, 0.00001, 0.025, 0.0251, 0.05, 0.3, 7.0, 30.0, 1e9, -1.0, 0.02, 0.02]


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for metric in registry.collect() for s in metric.samples
            if not s.name.endswith("_created")}  # (when each was made: the proxy switches these off)


def twins(kind, *args, **kwargs):
    one, other = CollectorRegistry(), CollectorRegistry()
    return one, kind("m", "m", ["a"], registry=one, **kwargs).labels("x"), other, kind("m", "m", ["a"], registry=other, **kwargs).labels("x")


@pytest.mark.parametrize("buckets", [TTFT_BUCKETS, GAP_BUCKETS])
def test_a_histogram_observed_on_cells_reads_as_the_library_makes_it(buckets):
    library, a, direct, b = twins(Histogram, buckets=buckets)
    fast = observer(b)
    assert isinstance(b._sum, Cell) and all(isinstance(bucket, Cell) for bucket in b._buckets)
    for value in [*VALUES, *buckets]:  # (each bound itself: in its own bucket, `le`)
        a.observe(value)
        fast(value)
    b.observe(0.07, {"trace_id": "ab"})  # (the library's own call, with its exemplar, on the cells)
    a.observe(0.07, {"trace_id": "ab"})
    assert samples(library) == samples(direct)
    exemplars = [[s.exemplar for s in m.samples if s.exemplar] for r in (library, direct) for m in r.collect()]
    assert exemplars[0] and [e.labels for e in exemplars[0]] == [e.labels for e in exemplars[1]] == [{"trace_id": "ab"}]


def test_a_nan_goes_through_the_library():
    library, a, direct, b = twins(Histogram, buckets=TTFT_BUCKETS)
    a.observe(math.nan)
    observer(b)(math.nan)
    left, right = samples(library), samples(direct)
    assert left.keys() == right.keys()
    assert all((math.isnan(left[k]) and math.isnan(right[k])) or left[k] == right[k] for k in left)


def test_a_summary_and_a_counter_observed_on_cells():
    library, a, direct, b = twins(Summary)
    fast = observer(b)
    for value in VALUES:
        a.observe(value)
        fast(value)
    assert samples(library) == samples(direct)
    library, a, direct, b = twins(Counter)
    fast = increment(b)
    for value in (1, 0.25, 3):
        a.inc(value)
        fast(value)
    b.inc(2)  # (the library's own call, on the cell)
    a.inc(2)
    assert samples(library) == samples(direct) and direct.get_sample_value("m_total", {"a": "x"}) == 6.25


def test_a_child_already_on_cells_keeps_its_values():
    """A label set's series made again (after another's removal) finds its children on cells already: kept, not reset."""
    _, _, direct, b = twins(Histogram, buckets=TTFT_BUCKETS)
    observer(b)(0.03)
    observer(b)(0.03)
    assert direct.get_sample_value("m_count", {"a": "x"}) == 2


def test_observe_many_equals_observing_one_by_one():
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
