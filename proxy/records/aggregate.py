"""What Python makes of a window's counts (sql.py computes them in the store): one `Aggregate` per
group, with its exact counts and sums, its histograms (a percentile is read within one bucket: 1%),
its SLO verdicts and misses by blamed phase, and the fits' samples; `read` gathers them from one or
more stores, `summary` is the live page's line.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from . import columns as C
from .sql import FIT_PARTS, KINDS, MEAN_SUMS, SAMPLE, SUMS, Window

if TYPE_CHECKING:
    from . import Backend, Filters


@dataclass
class Span:
    """The first arrival and the last end of a population (wall clock, ns)."""

    start: int | None = None
    end: int | None = None

    def add(self, start: int | None, end: int | None) -> None:
        if start is not None:
            self.start = start if self.start is None else min(self.start, start)
        if end is not None:
            self.end = end if self.end is None else max(self.end, end)

    @property
    def seconds(self) -> float:
        return max(1e-9, ((self.end or 0) - (self.start or 0)) / 1e9)


@dataclass
class Judged:
    """One objective's verdicts in a group."""

    judged: int = 0
    good: int = 0
    span: Span = field(default_factory=Span)
    misses: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)


@dataclass
class Aggregate:
    """One group's figures over a window: exact counts and sums, histograms, and the fits' samples."""

    requests: int = 0
    ok: int = 0
    streams: int = 0
    completion: int = 0
    load_max: float = 0.0
    ok_span: Span = field(default_factory=Span)
    apis: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    fits: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [0.0] * 6, "decode": [0.0] * 6})
    summary: dict[str, list[int]] = field(default_factory=lambda: {name: [0] * (len(b) + 1) for name, b in C.SUMMARY_BOUNDS.items()})
    cells: dict[int, collections.Counter[int]] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    slos: dict[str, Judged] = field(default_factory=lambda: collections.defaultdict(Judged))
    slo_requests: collections.Counter[str] = field(default_factory=collections.Counter)  # judged or not
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEAN_SUMS, 0.0))  # over the ok requests (store version 3, lag 6)
    known: int = 0  # ok requests whose rollup rows hold those sums (a version 2 replica's do not)
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {"prefill": [], "decode": []})

    def add_sums(self, kinds: dict[str, Any], sums: dict[str, Any]) -> None:
        n = int(sums["requests"])
        self.requests += n
        self.apis[f"{kinds['api']} {kinds['endpoint']}"] += n
        self.outcomes[kinds["outcome"]] += n
        for name, bounds in C.SUMMARY_BOUNDS.items():  # [≤ first bound, ≤ second, …, all]: cumulative
            counts = self.summary[name]
            for i in range(len(bounds)):
                counts[i] += int(sums[f"{name}_le_{i}"])
            counts[-1] += int(sums[f"{name}_n"])
        if kinds["outcome"] == "ok":
            self.ok += n
            self.streams += int(sums["streams"])
            self.completion += int(sums["completion"])
            self.load_max = max(self.load_max, float(sums["load_max"] or 0.0))
            self.ok_span.add(sums["received_min"], sums["ended_max"])
            for fit in ("prefill", "decode"):
                acc = self.fits[fit]
                for i, part in enumerate(FIT_PARTS):
                    acc[i] += float(sums[f"{fit}_{part}"])
            if sums["e2e_sum"] is not None:
                self.known += n
                for name in MEAN_SUMS:
                    self.sums[name] += float(sums[name] or 0.0)
        if kinds["slo"]:
            self.slo_requests[kinds["slo"]] += n
        if kinds["slo"] and kinds["verdict"]:
            judged = self.slos[kinds["slo"]]
            judged.judged += n
            judged.good += n if kinds["verdict"] == "good" else 0
            judged.span.add(sums["received_min"], sums["ended_max"])
            for pair in kinds["blame"].split(";") if kinds["blame"] else ():
                missed, _, blamed = pair.partition("=")
                judged.misses[(missed, blamed)] += n

    def add_cell(self, code: int, index: int, n: int) -> None:
        self.cells[code][index] += n

    def count(self, code: int) -> int:
        return sum(self.cells.get(code, {}).values())

    def total(self, code: int) -> float:
        """A figure's sum over its records (each value its bucket's middle: within 1%)."""
        return sum(n * (float(index) if code in C.EXACT else C.middle(index)) for index, n in self.cells.get(code, {}).items())

    def quantile(self, code: int, q: float = 0.5, zeros: int = 0) -> float | None:
        """The q-quantile of a figure (with `zeros` more values of 0), as `statistics.median` reads
        ranks: between the two middle values for an even count. Within one bucket (1%)."""
        counts = dict(self.cells.get(code) or {})
        if zeros:
            counts[C.ZERO] = counts.get(C.ZERO, 0) + zeros
        total = sum(counts.values())
        if total == 0:
            return None
        items = sorted(counts.items())
        position = q * (total - 1)
        low = int(position)
        high = min(total - 1, low + (position > low))

        def at(rank: int) -> float:
            seen = 0
            for index, n in items:
                seen += n
                if rank < seen:
                    return float(index) if code in C.EXACT else C.middle(index)
            return C.middle(items[-1][0])

        a, b = at(low), at(high)
        return a + (b - a) * (position - low)

    def summary_quantile(self, name: str, q: float) -> float | None:
        """A quantile of TTFT or end to end from the coarse buckets, as Prometheus' histogram_quantile
        reads them: linear within the bucket; the last bound when it falls past it."""
        bounds, counts = C.SUMMARY_BOUNDS[name], self.summary[name]
        total = counts[-1]
        if not total:
            return None
        rank, low, below = q * total, 0.0, 0
        for bound, cumulative in zip(bounds, counts):
            if cumulative >= rank:
                return low + (bound - low) * ((rank - below) / max(1, cumulative - below))
            low, below = bound, cumulative
        return bounds[-1]

    def levels(self) -> dict[int, int]:
        """Requests per concurrency level they began decoding at."""
        return dict(self.cells.get(C.LEVEL, {}))


class Fold:
    """A window's rows folded into one Aggregate per group as the store's cursor yields them: a day's
    histograms are millions of rows, never held as a list of tuples (bench store explain-window)."""

    def __init__(self, by: tuple[str, ...]) -> None:
        self.by = by
        self.groups: dict[tuple[Any, ...], Aggregate] = collections.defaultdict(Aggregate)
        self._keys = (*by, *(k for k in KINDS if k not in by))
        self._names = [name for name, _, _ in SUMS]

    def sums(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """The rollup's rows: a group's kinds, then its sums (as `queries` selects them)."""
        keys, names, width = self._keys, self._names, len(self._keys)
        for row in rows:
            values = dict(zip(keys, row))
            self.groups[tuple(values[k] for k in self.by)].add_sums(values, dict(zip(names, row[width:])))

    def cells(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """The histograms' rows: a group, then (figure, bucket, count)."""
        width, groups = len(self.by), self.groups
        key: tuple[Any, ...] | None = None
        cells: dict[int, collections.Counter[int]] = {}
        for row in rows:
            if row[:width] != key:  # (a group's rows mostly come together)
                key = row[:width]
                cells = groups[key].cells
            cells[row[-3]][row[-2]] += row[-1]  # (integers, as the stores read them: sql.Dialect.counted)

    def merge_cells(self, other: Fold) -> None:
        """Another connection's share of the histograms (PostgreSQL reads them on two at once)."""
        for key, agg in other.groups.items():
            mine = self.groups[key].cells
            for code, counts in agg.cells.items():
                mine[code].update(counts)


def read(stores: list[Backend], by: tuple[str, ...], window: Window, samples: bool = False,
         histograms: bool = True) -> dict[tuple[str, ...], Aggregate]:
    """One window's aggregates over one or more stores, per group `by` (dimensions); without
    `histograms`, counts and sums only; with `samples` (by model and upstream), each fit's sample: the
    lowest keys of all the stores together."""
    folded = Fold(by)
    for store in stores:
        store.aggregate(folded, window, histograms)
    groups = dict(folded.groups)
    if samples:
        wanted = [(fit, model, upstream, int(agg.fits[fit][0])) for (model, upstream), agg in groups.items() for fit in ("prefill", "decode")]
        found = [store.samples(wanted, window) for store in stores]
        for i, (fit, model, upstream, _) in enumerate(wanted):
            points = sorted(point for rows in found for point in rows[i])  # (the lowest keys of every store together)
            groups[(model, upstream)].samples[fit] = [(x, y) for _, x, y in points[:SAMPLE]]
    return groups


def summary(store: Backend, since_s: float, filters: Filters) -> dict[str, Any]:
    """A live page's summary of one store since `since_s` ago (from the start of that ten-minute block:
    the rollup alone), requests by outcome, TTFT and end-to-end percentiles, each SLO's attainment."""
    start = time.time_ns() - int(since_s * 1e9) if since_s > 0 else 0
    window = Window(start, tuple(filters.equal()), whole_blocks=True)
    agg = read([store], (), window, histograms=False).get((), Aggregate())
    quantiles = {f"{name}_s": {f"p{round(q * 100)}": agg.summary_quantile(name, q) for q in (0.5, 0.9, 0.99)} for name in C.SUMMARY_BOUNDS}
    out: dict[str, Any] = {"since_unix_ns": window.first_block, "requests": agg.requests, "outcomes": dict(agg.outcomes.most_common()),
                           **quantiles, "slo": {name: {"judged": j.judged, "good": j.good, "attainment": j.good / j.judged if j.judged else None}
                                                for name, j in sorted(agg.slos.items())},
                           "precision": "percentiles within their bucket of the Prometheus histograms (linear inside it, as histogram_quantile)"}
    return out
