"""One label set's series: the children a finished request observes, bound once, observed directly.

Why: `ProxyMetrics.observe` touches about 25 children a request. Each was found by a tuple of its
name and labels, then observed through prometheus_client's public calls (an observability check, a
Python loop over a histogram's buckets, and a lock taken for each of its 37 increments): 40 µs a
request in process, and 93 µs at 16 streams, where nothing stays in the CPU's caches from one request
to the next (bench/RESULTS.md). Here a request's label set finds its children in one lookup, and each
child's values (its count, its sum, its buckets) are `Cell`s: a float the event loop alone writes,
incremented in place. The library's own calls and its exposition still work on them (a cell has a
mutex value's methods), so the scrape reads what it read before. Only the per-request families
observed from the event loop get cells, and only in a single process: with workers the values are
the multiprocess files, observed through the library's own calls as before. Through the library
still: an observation with an exemplar (validated), a NaN (in no bucket), and counts from the
upstream (tokens: a negative one must raise, as it did, never decrement a counter).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any, Callable

Observe = Callable[[float], None]


class Cell:
    """A metric value written by one thread (the event loop) and read by any: prometheus_client's mutex
    value without its mutex. An increment is a float's `+=`, which no other thread interleaves with here,
    and a reader sees the float before or after it."""

    __slots__ = ("v", "exemplar")

    def __init__(self, value: float = 0.0) -> None:
        self.v, self.exemplar = value, None

    def inc(self, amount: float) -> None:
        self.v += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.v = value

    def get(self) -> float:
        return self.v

    def set_exemplar(self, exemplar: Any) -> None:
        self.exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self.exemplar


def _cell(value: Any) -> Cell:
    return value if isinstance(value, Cell) else Cell(value.get())


def on_cells(child: Any) -> None:
    """The child's values (a counter's value; a summary's count and sum; a histogram's sum and buckets) made
    cells, their counts kept (a child already on cells, from a label set's series made again, stays as it is)."""
    for name in ("_value", "_count", "_sum"):
        if hasattr(child, name):
            setattr(child, name, _cell(getattr(child, name)))
    if hasattr(child, "_buckets"):
        child._buckets = [_cell(bucket) for bucket in child._buckets]


def increment(child: Any) -> Observe:
    """A counter's increment by a non-negative amount, on its cell."""
    on_cells(child)
    cell = child._value

    def inc(amount: float) -> None:
        cell.v += amount

    return inc


def observer(child: Any) -> Observe:
    """A histogram's or summary's observation, as the library makes it, on its cells."""
    on_cells(child)
    total = child._sum
    if hasattr(child, "_buckets"):
        buckets, bounds, slow = child._buckets, list(child._upper_bounds), child.observe

        def histogram(value: float) -> None:
            if value != value:  # NaN: in no bucket, as the library has it
                slow(value)
                return
            total.v += value
            buckets[bisect_left(bounds, value)].v += 1  # (the first bucket whose bound is >= the value: the library's loop)

        return histogram
    count = child._count

    def summary(value: float) -> None:
        count.v += 1
        total.v += value

    return summary


class Series:
    """The children of one request label set (its model, upstream, endpoint, stream and tenant: metrics.TENANTED),
    each made on first use through `child` (ProxyMetrics.child: bound once, per label values) and kept here with
    its direct observation, on cells when `cells` (one process; the event loop its only writer), else the
    library's own (with workers: the multiprocess files). `leading`: for each family, the positions in the set
    of its leading labels (derived from metrics.METRICS, where each family's labels are defined once)."""

    __slots__ = ("child", "cells", "tenanted", "leading", "_made")

    def __init__(self, child: Callable[..., Any], tenanted: tuple[str, ...], cells: bool, leading: dict[str, tuple[int, ...]]) -> None:
        self.child, self.cells, self.tenanted, self.leading = child, cells, tenanted, leading
        self._made: dict[tuple[str, tuple[str, ...] | None], Any] = {}

    def observe(self, name: str, *labels: str) -> Observe:
        """What one value does to the child of this set's labels and `labels` (with the labels `name` takes, see
        `labels_of`): a counter's increment, a histogram's or summary's observation."""
        made = self._made.get((name, labels))
        if made is None:
            child = self.child(name, *self.labels_of(name), *labels)
            counter = hasattr(child, "_value")
            if self.cells:
                made = increment(child) if counter else observer(child)
            else:
                made = child.inc if counter else child.observe
            self._made[(name, labels)] = made
        return made

    def many(self, name: str) -> Any:
        """A histogram's or summary's child itself, for `observe_many` (on cells when `cells`)."""
        made = self._made.get((name, None))
        if made is None:
            made = self._made[(name, None)] = self.child(name, *self.labels_of(name))
            if self.cells:
                on_cells(made)
        return made

    def labels_of(self, name: str) -> tuple[str, ...]:
        """The family's leading label values taken from this set (the whole set, its first four, (upstream,
        endpoint, stream), or the upstream)."""
        return tuple(self.tenanted[i] for i in self.leading[name])


def observe_many(child: Any, values: list[float], bounds: tuple[float, ...] = ()) -> None:
    """Observe a request's inter-token gaps (often hundreds) with one increment per bucket used
    (histograms) or one for the count and one for the sum (summaries).

    Equivalent to calling `observe` for each value, without a lock round-trip per value; falls
    back to that if prometheus_client's children ever stop looking like 0.2x's.
    """
    if not values:
        return
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    count = getattr(child, "_count", None)
    if not bounds and count is not None and total is not None:
        count.inc(len(values))
        total.inc(sum(values))
        return
    if buckets is None or total is None or len(buckets) != len(bounds) + 1 or len(values) < 8:
        for value in values:
            child.observe(value)
        return
    counts = [0] * len(buckets)
    for value in values:
        counts[bisect_left(bounds, value)] += 1
    for index, n in enumerate(counts):
        if n:
            buckets[index].inc(n)
    total.inc(sum(values))
