"""The SQL both stores run to count a window of records, so that a day of a fleet's traffic is
thousands of rows, not millions (what `explain`, the SLO summaries and `/ui` read; aggregate.py
holds what Python makes of the counts).

Two tables beside the records, both by hour (a record counts in the hour it ended):
- `llmproxy_rollup`, written with each batch in its transaction: per hour and *series* (instance,
  model, upstream, API, endpoint, outcome, objective, verdict), counts, sums, the window's ends, the
  two fits' sums and cross-sums (`SUMS`), and TTFT and end to end in the Prometheus histograms'
  buckets (the live summary's). Exact and current: a window reads its whole hours here.
- `llmproxy_hist`, compacted: per hour, model, upstream and objective, how many records had each
  figure in each bucket (columns.py). A histogram at 1% resolution has hundreds of buckets per
  figure, more than an hour of one model holds records in a batch, so counting it with each batch
  would write more rows than records; instead, once an hour has ended (`SETTLE_S` later), one pass
  over its records computes it (`compact`), and again if records reach it afterwards (a store that
  was down, an import), which mark it dirty.

A window's counts and sums: its whole hours from the rollup, its first partial hour from the records.
Its histograms: compacted hours from `llmproxy_hist`, every other part of it (the first partial hour,
the hours not compacted yet or dirty) from the records, by the same SQL (`cells`). A `Dialect` holds
the two stores' few differences. What crosses to Python: one row per group and series kind, one per
group, figure and bucket, and each fit's sample (`SAMPLE` points, the lowest keys: a uniform sample).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from . import columns as C

SAMPLE = 2000  # points per fit read from the store; its Theil-Sen slope uses the first PAIRS of them
PAIRS = 300
SETTLE_S = 120.0  # an hour is compacted this long after it ended (later records mark it dirty)
LATE_S = 300.0  # a record whose hour ends before this long from now marks it dirty (clocks may disagree by SETTLE_S less)
KINDS = ("api", "endpoint", "outcome", "slo", "verdict")  # what a group's sums are kept apart by (its populations)
HIST_DIMS = ("model", "upstream", "slo")  # what the compacted histograms are kept by
_FIT = (("n", "count({x})"), ("x", "coalesce(sum({x}), 0)"), ("y", "coalesce(sum({y}), 0)"), ("xx", "coalesce(sum({x} * {x}), 0)"),
        ("xy", "coalesce(sum({x} * {y}), 0)"), ("yy", "coalesce(sum({y} * {y}), 0)"))
# (column, SQL over records, how two partial values merge)
SUMS = (
    ("requests", "count(*)", "sum"),
    ("streams", f"sum(CASE WHEN {C.STREAM} THEN 1 ELSE 0 END)", "sum"),
    ("completion", "sum(completion)", "sum"),
    ("received_min", "min(received_ns)", "min"),
    ("ended_max", "max(ended_ns)", "max"),
    ("load_max", "max(coalesce(ph_load, 0))", "max"),
    *((f"{fit}_{part}", expr.format(x=f"{fit[0]}x", y=f"{fit[0]}y"), "sum") for fit in ("prefill", "decode") for part, expr in _FIT),
    *((f"{name}_n", f"count({column})", "sum") for name, column in C.SUMMARY_VALUES.items()),
    *((f"{name}_le_{i}", f"sum(CASE WHEN {C.SUMMARY_VALUES[name]} <= {bound!r} THEN 1 ELSE 0 END)", "sum")
      for name, bounds in C.SUMMARY_BOUNDS.items() for i, bound in enumerate(bounds)),
)
FIT_PARTS = tuple(part for part, _ in _FIT)
FLOATS = ("_x", "_y", "_xx", "_xy", "_yy", "load_max")  # the real-valued sums (the rest are integers)


@dataclass(frozen=True)
class Dialect:
    """What differs between the two stores' SQL."""

    param: str  # "?" or "%s"
    least: str  # the two-argument minimum: LEAST (PostgreSQL) or min (SQLite)
    greatest: str
    grouping_sets: bool  # every figure in one pass (PostgreSQL: 3x faster than a pass each, which SQLite does)

    def sql(self, text: str) -> str:
        return text.replace("?", self.param)


POSTGRES = Dialect("%s", "LEAST", "GREATEST", True)
SQLITE = Dialect("?", "min", "max", False)


def _merge(kind: str, column: str, dialect: Dialect) -> str:
    old, new = f"llmproxy_rollup.{column}", f"excluded.{column}"
    return {"sum": f"{old} + {new}", "min": f"{dialect.least}({old}, {new})", "max": f"{dialect.greatest}({old}, {new})"}[kind]


def rollup(dialect: Dialect, source: str) -> str:
    """The statement that adds the records of `source` (aliased `r`) to the rollup. (SQLite needs a
    WHERE before an upsert's ON CONFLICT; the ORDER BY takes the rows' locks in one order.)"""
    dims = ", ".join(C.DIMENSIONS)
    return (f"INSERT INTO llmproxy_rollup (hour, series, {dims}, {', '.join(name for name, _, _ in SUMS)}) "
            f"SELECT r.ended_ns / {C.HOUR_NS}, r.series, {dims}, {', '.join(expr for _, expr, _ in SUMS)} FROM {source} r WHERE true "
            f"GROUP BY r.ended_ns / {C.HOUR_NS}, r.series, {dims} ORDER BY 1, 2 ON CONFLICT (hour, series) DO UPDATE SET "
            + ", ".join(f"{name} = {_merge(kind, name, dialect)}" for name, _, kind in SUMS))


def cells(dialect: Dialect, keys: Iterable[str], where: str) -> str:
    """Every figure's (keys..., code, bucket, n) over the records `where` selects (an SQL condition)."""
    names = ", ".join(keys)
    value = [f.value if f.code in C.EXACT else C.bucket_sql(f.value) for f in C.FIGURES]
    if dialect.grouping_sets:  # one pass: a column per figure, NULL outside its population; a grouping set each
        columns = ", ".join(f"CASE WHEN {f.where} THEN {v} END AS b{i}" for i, (f, v) in enumerate(zip(C.FIGURES, value)))
        which = "CASE " + " ".join(f"WHEN GROUPING(b{i}) = 0 THEN {f.code}" for i, f in enumerate(C.FIGURES)) + " END"
        bucket = f"coalesce({', '.join(f'b{i}' for i in range(len(C.FIGURES)))})"
        sets = ", ".join(f"({names}, b{i})" for i in range(len(C.FIGURES)))
        return (f"SELECT {names}, {which} AS code, {bucket} AS bucket, count(*) AS n FROM (SELECT {names}, {columns} FROM llmproxy_records "
                f"WHERE {where}) s GROUP BY GROUPING SETS ({sets}) HAVING {bucket} IS NOT NULL")
    return (f"SELECT * FROM (WITH r AS MATERIALIZED (SELECT {READ} FROM llmproxy_records WHERE {where}) " + " UNION ALL ".join(
        f"SELECT {names}, {f.code} AS code, {v} AS bucket, count(*) AS n FROM r WHERE {f.where} GROUP BY {names}, bucket"
        for f, v in zip(C.FIGURES, value)) + ") u")


READ = ", ".join(sorted({*C.COLUMNS} - {"rid"}))  # what the cells read of a record (its JSON never)


def compact(dialect: Dialect) -> str:
    """The statement that computes one hour's histograms from its records (hour, from_ns, to_ns)."""
    dims = ", ".join(HIST_DIMS)
    return dialect.sql(f"INSERT INTO llmproxy_hist (hour, {dims}, code, bucket, n) SELECT ?, {dims}, code, bucket, n FROM "
                       f"({cells(dialect, HIST_DIMS, 'ended_ns >= ? AND ended_ns < ?')}) t")


@dataclass(frozen=True)
class Window:
    """Records that ended at or after `start_ns` (0: all), selected by `filters` (dimension = value).
    `whole_hours`: from the start of the hour `start_ns` falls in, read from the rollup alone (a live
    page's summary: no record read, whatever the volume)."""

    start_ns: int = 0
    filters: tuple[tuple[str, str], ...] = ()
    whole_hours: bool = False

    @property
    def first_hour(self) -> int:
        """The first hour read whole from the aggregates; before it, the records themselves."""
        if self.whole_hours:
            return self.start_ns // C.HOUR_NS
        return -(-self.start_ns // C.HOUR_NS) if self.start_ns > 0 else 0

    def where(self, alias: str = "") -> tuple[str, list[Any]]:
        prefix = f"{alias}." if alias else ""
        return "".join(f" AND {prefix}{name} = ?" for name, _ in self.filters), [value for _, value in self.filters]

    def split(self, compacted: Iterable[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """(the hours read from the histograms, the ns ranges read from the records) given the hours
        compacted and clean: the first partial hour, and every later hour not in `compacted`."""
        done = sorted(h for h in set(compacted) if h >= self.first_hour)
        ranges, at = [], self.start_ns
        for hour in done:
            if hour * C.HOUR_NS > at:
                ranges.append((at, hour * C.HOUR_NS))
            at = (hour + 1) * C.HOUR_NS
        ranges.append((at, 1 << 62))
        return done, ranges


def queries(dialect: Dialect, by: tuple[str, ...], window: Window, hours: list[int] | None = None,
            ranges: list[tuple[int, int]] | None = None) -> list[tuple[str, list[Any]]]:
    """(sums SQL, args) for the groups `by` (dimensions) of a window, and with `hours` and `ranges`
    (`Window.split`) its (cells SQL, args): `by` and the filters among HIST_DIMS then."""
    hour = window.first_hour
    keys = ", ".join((*by, *(k for k in KINDS if k not in by)))
    filt, fargs = window.where()
    outer = ", ".join(f"{kind}({name})" for name, _, kind in SUMS)
    parts = [f"SELECT {keys}, {', '.join(name for name, _, _ in SUMS)} FROM llmproxy_rollup WHERE hour >= ?{filt}"]
    args: list[Any] = [hour, *fargs]
    if window.start_ns > 0 and not window.whole_hours:
        parts.append(f"SELECT {keys}, {', '.join(expr for _, expr, _ in SUMS)} FROM llmproxy_records "
                     f"WHERE ended_ns >= ? AND ended_ns < ?{filt} GROUP BY {keys}")
        args += [window.start_ns, hour * C.HOUR_NS, *fargs]
    out = [(dialect.sql(f"SELECT {keys}, {outer} FROM ({' UNION ALL '.join(parts)}) t GROUP BY {keys}"), args)]
    if hours is None or ranges is None:
        return out
    if not set(by) <= set(HIST_DIMS) or not {name for name, _ in window.filters} <= set(HIST_DIMS):
        raise ValueError(f"histograms are kept by {', '.join(HIST_DIMS)} only")
    cell_keys = (*by, *(["slo"] if "slo" not in by else []))
    names = ", ".join(cell_keys)
    within = " OR ".join("(ended_ns >= ? AND ended_ns < ?)" for _ in ranges)
    text = f"SELECT {names}, code, bucket, sum(n) FROM ({cells(dialect, cell_keys, f'({within}){filt}')}"
    cargs: list[Any] = [bound for pair in ranges for bound in pair] + fargs
    if hours:
        text += f" UNION ALL SELECT {names}, code, bucket, n FROM llmproxy_hist WHERE hour IN ({', '.join('?' * len(hours))}){filt}"
        cargs += [*hours, *fargs]
    out.append((dialect.sql(text + f") t GROUP BY {names}, code, bucket"), cargs))
    return out


def sample(dialect: Dialect, fit: str, window: Window) -> tuple[str, list[Any]]:
    """The fit's points of one model on one upstream (two more parameters) with the lowest keys."""
    x, y = f"{fit[0]}x", f"{fit[0]}y"
    text = (f"SELECT key, {x}, {y} FROM llmproxy_records WHERE model = ? AND upstream = ? AND {x} IS NOT NULL AND ended_ns >= ? "
            f"ORDER BY key LIMIT {SAMPLE}")
    return dialect.sql(text), [window.start_ns]


def compactable(now_ns: int) -> int:
    """The hours before this one have ended at least SETTLE_S ago: they may be compacted."""
    return (now_ns - int(SETTLE_S * 1e9)) // C.HOUR_NS


def late_hours(ended: Iterable[int], now_ns: int) -> list[int]:
    """The hours of these records (end times) that a compaction may have read already: writing them
    marks those hours dirty, under the compaction lock's shared side."""
    horizon = (now_ns + int(LATE_S * 1e9)) // C.HOUR_NS
    return sorted({end // C.HOUR_NS for end in ended if end // C.HOUR_NS < horizon})
