"""The SQL both stores run to count a window of records, so that a day of a fleet's traffic is
thousands of rows, not millions (what `explain`, the SLO summaries and `/ui` read; aggregate.py
holds what Python makes of the counts).

Beside the records, by the ten-minute block a record ended in (`BLOCK_NS`):
- `llmproxy_rollup`, written with each batch in its transaction: per block and *series* (instance,
  model, upstream, API, endpoint, outcome, objective, verdict), counts, sums, the window's ends, the
  two fits' sums and cross-sums (`SUMS`), and TTFT and end to end in the Prometheus histograms'
  buckets (the live summary's). Exact and current: a window reads its whole blocks here.
- `llmproxy_hist_block` and `llmproxy_hist`, compacted: per ten-minute block (kept `BLOCKS_KEPT_S`)
  and per hour (kept as long as the records), model, upstream and objective, how many records had
  each figure in each bucket (columns.py). A histogram at 1% resolution has hundreds of buckets per
  figure, more than a batch brings records of one model, so counting it with each batch would
  write more rows than records; instead, `SETTLE_S` after a block ends, one pass over its records
  computes it (`compact_block`), and an hour is the sum of its six blocks (`compact_hour`; from
  its records when its blocks are gone). Records that reach a block or an hour that may be
  compacted already (a store that was down, an import, a clock behind) mark it dirty, and it is
  computed again; writers hold the compaction lock's shared side, a compaction its other side.

A window's counts and sums: its whole blocks from the rollup, its first partial block from the
records. Its histograms: the compacted hours and blocks it covers whole, and the rest (its first
partial block, what was not compacted yet: the last ten minutes or so) from the records, by the
same SQL (`cells`). A `Dialect` holds the two stores' few differences. What crosses to Python: one
row per group and series kind, one per group, figure and bucket, and each fit's sample (`SAMPLE`
points, the lowest keys: a uniform sample).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable

from . import columns as C

SAMPLE = 2000  # points per fit read from the store; its Theil-Sen slope uses the first PAIRS of them
PAIRS = 300
BLOCK_NS = 600 * 1_000_000_000  # the aggregates' time block: ten minutes
BLOCKS_KEPT_S = 2 * 86400.0  # the ten-minute histograms are kept this long (a window's first partial hour within it reads them)
SETTLE_S = 60.0  # a block (an hour) is compacted this long after it ended, by the store's clock
INF_NS = 1 << 62
KINDS = ("api", "endpoint", "outcome", "slo", "verdict", "blame")  # what a group's sums are kept apart by (its populations)
HIST_DIMS = ("model", "upstream")  # what the compacted histograms are kept by
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
    # (store version 3) What a group's mean request is made of, exactly: prompt tokens, and the seconds
    # of each phase, TTFT and end to end (`explain --by tenant`: whose prompts are long, whose requests queue).
    ("prompt", "sum(prompt)", "sum"),
    *((f"{name}_sum", f"sum({column})", "sum") for name, column in (("ttft", "ttft_s"), ("e2e", "duration_s"), *((p, f"ph_{p}") for p in C.PHASES))),
)
V3_SUMS = ("prompt", *(f"{name}_sum" for name in ("ttft", "e2e", *C.PHASES[:C.PHASES.index("lag")])))  # the columns store version 3 added
V6_SUMS = ("lag_sum",)  # ... and version 6
MEAN_SUMS = V3_SUMS + V6_SUMS  # what a group's mean request is read from (aggregate.py)
FIT_PARTS = tuple(part for part, _ in _FIT)
FLOATS = ("_x", "_y", "_xx", "_xy", "_yy", "load_max", "_sum")  # the real-valued sums (the rest are integers)


@dataclass(frozen=True)
class Dialect:
    """What differs between the two stores' SQL."""

    param: str  # "?" or "%s"
    least: str  # the two-argument minimum: LEAST (PostgreSQL) or min (SQLite)
    greatest: str
    grouping_sets: bool  # every figure in one pass (PostgreSQL: 3x faster than a pass each, which SQLite does)
    counted: str  # a sum of counts as an integer (PostgreSQL's sum of a bigint is a numeric, read as a Decimal: slower)

    def sql(self, text: str) -> str:
        return text.replace("?", self.param)


POSTGRES = Dialect("%s", "LEAST", "GREATEST", True, "sum(n)::bigint")
SQLITE = Dialect("?", "min", "max", False, "sum(n)")


def _merge(kind: str, column: str, dialect: Dialect) -> str:
    old, new = f"llmproxy_rollup.{column}", f"excluded.{column}"
    return {"sum": f"{old} + {new}", "min": f"{dialect.least}({old}, {new})", "max": f"{dialect.greatest}({old}, {new})"}[kind]


def rollup(dialect: Dialect, source: str) -> str:
    """The statement that adds the records of `source` (aliased `r`) to the rollup. (SQLite needs a
    WHERE before an upsert's ON CONFLICT; the ORDER BY takes the rows' locks in one order.)"""
    dims = ", ".join(C.DIMENSIONS)
    block = f"r.ended_ns / {BLOCK_NS} * {BLOCK_NS}"  # (the start of its block: integer division in both stores)
    return (f"INSERT INTO llmproxy_rollup (start, series, {dims}, {', '.join(name for name, _, _ in SUMS)}) "
            f"SELECT {block}, r.series, {dims}, {', '.join(expr for _, expr, _ in SUMS)} FROM {source} r WHERE true "
            f"GROUP BY {block}, r.series, {dims} ORDER BY 1, 2 ON CONFLICT (start, series) DO UPDATE SET "
            + ", ".join(f"{name} = {_merge(kind, name, dialect)}" for name, _, kind in SUMS))


def cells(dialect: Dialect, keys: Iterable[str], where: str) -> str:
    """Every figure's (keys..., code, bucket, n) over the records `where` selects (an SQL condition)."""
    names = "".join(f"{key}, " for key in keys)
    value = [f.value if f.code in C.EXACT else C.bucket_sql(f.value) for f in C.FIGURES]
    if dialect.grouping_sets:  # one pass: a column per figure, NULL outside its population; a grouping set each
        columns = ", ".join(f"CASE WHEN {f.where} THEN {v} END AS b{i}" for i, (f, v) in enumerate(zip(C.FIGURES, value)))
        which = "CASE " + " ".join(f"WHEN GROUPING(b{i}) = 0 THEN {f.code}" for i, f in enumerate(C.FIGURES)) + " END"
        bucket = f"coalesce({', '.join(f'b{i}' for i in range(len(C.FIGURES)))})"
        sets = ", ".join(f"({names}b{i})" for i in range(len(C.FIGURES)))
        return (f"SELECT {names}{which} AS code, {bucket} AS bucket, count(*) AS n FROM (SELECT {names}{columns} FROM llmproxy_records "
                f"WHERE {where}) s GROUP BY GROUPING SETS ({sets}) HAVING {bucket} IS NOT NULL")
    return (f"SELECT * FROM (WITH r AS MATERIALIZED (SELECT {READ} FROM llmproxy_records WHERE {where}) " + " UNION ALL ".join(
        f"SELECT {names}{f.code} AS code, {v} AS bucket, count(*) AS n FROM r WHERE {f.where} GROUP BY {names}bucket"
        for f, v in zip(C.FIGURES, value)) + ") u")


READ = ", ".join(sorted({*C.COLUMNS} - {"rid"}))  # what the cells read of a record (its JSON never)


HISTS = {BLOCK_NS: "llmproxy_hist_block", C.HOUR_NS: "llmproxy_hist"}  # the histograms of each span


def compact_block(dialect: Dialect) -> str:
    """The statement that computes one block's histograms from its records (start, start, end)."""
    dims = ", ".join(HIST_DIMS)
    return dialect.sql(f"INSERT INTO llmproxy_hist_block (start, {dims}, code, bucket, n) SELECT ?, {dims}, code, bucket, n FROM "
                       f"({cells(dialect, HIST_DIMS, 'ended_ns >= ? AND ended_ns < ?')}) t")


def compact_hour(dialect: Dialect, from_blocks: bool) -> str:
    """One hour's histograms (start, start, end): the sum of its blocks', or from its records."""
    if not from_blocks:
        return compact_block(dialect).replace("llmproxy_hist_block", "llmproxy_hist")
    dims = ", ".join(HIST_DIMS)
    return dialect.sql(f"INSERT INTO llmproxy_hist (start, {dims}, code, bucket, n) SELECT ?, {dims}, code, bucket, sum(n) "
                       f"FROM llmproxy_hist_block WHERE start >= ? AND start < ? GROUP BY {dims}, code, bucket")


# What a compaction pass takes next (span, start; parameters: the oldest block still kept, now less
# SETTLE_S): a block or an hour that has records, ended SETTLE_S ago, and is not compacted or is dirty;
# the blocks first (an hour is the sum of its blocks), each oldest first.
DUE = (f"SELECT span, start FROM (SELECT DISTINCT {BLOCK_NS} AS span, start FROM llmproxy_rollup WHERE start >= ? "
       f"UNION SELECT DISTINCT {C.HOUR_NS}, start / {C.HOUR_NS} * {C.HOUR_NS} FROM llmproxy_rollup) u WHERE start + span <= ? "
       "AND ((span, start) IN (SELECT span, start FROM llmproxy_dirty) OR (span, start) NOT IN (SELECT span, start FROM llmproxy_compacted)) "
       "ORDER BY span, start")


@dataclass(frozen=True)
class Window:
    """Records that ended at or after `start_ns` (0: all), selected by `filters` (dimension = value).
    `whole_blocks`: from the start of the block `start_ns` falls in (`since_ns`), so that no record
    before the last block is read: sums and counts from the rollup alone (a live page's summary),
    histograms from the compacted blocks (`explain --since`)."""

    start_ns: int = 0
    filters: tuple[tuple[str, str], ...] = ()
    whole_blocks: bool = False

    @property
    def first_block(self) -> int:
        """The first block read whole from the aggregates (ns); before it, the records themselves."""
        if self.whole_blocks:
            return self.start_ns - self.start_ns % BLOCK_NS
        return -(-self.start_ns // BLOCK_NS) * BLOCK_NS if self.start_ns > 0 else 0

    @property
    def since_ns(self) -> int:
        """Where the window really starts: `start_ns`, or with `whole_blocks` the start of its block."""
        return self.first_block if self.whole_blocks else self.start_ns

    def where(self, alias: str = "") -> tuple[str, list[Any]]:
        prefix = f"{alias}." if alias else ""
        return "".join(f" AND {prefix}{name} = ?" for name, _ in self.filters), [value for _, value in self.filters]

    def plan(self, hours: Iterable[int], blocks: Iterable[int]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """(the hours and the blocks read from the histograms, the ns ranges read from the records),
        given the hours and blocks compacted and clean: every whole hour it can, then every whole
        block, and the records for the rest."""
        hours, blocks = {h for h in hours if h >= self.first_block}, {b for b in blocks if b >= self.first_block}
        use_hours: list[int] = []
        use_blocks: list[int] = []
        ranges: list[tuple[int, int]] = []
        raw_from = self.since_ns
        at = max(self.first_block, min(hours | blocks, default=INF_NS))
        end = max([h + C.HOUR_NS for h in hours] + [b + BLOCK_NS for b in blocks], default=0)
        while at < end:
            if at % C.HOUR_NS == 0 and at in hours:
                use_hours.append(at)
                step = C.HOUR_NS
            elif at in blocks:
                use_blocks.append(at)
                step = BLOCK_NS
            else:
                at += BLOCK_NS
                continue
            if raw_from < at:
                ranges.append((raw_from, at))
            at += step
            raw_from = at
        ranges.append((raw_from, INF_NS))
        return use_hours, use_blocks, ranges


def queries(dialect: Dialect, by: tuple[str, ...], window: Window, plan: tuple[list[int], list[int], list[tuple[int, int]]] | None = None,
            split: int = 1) -> list[tuple[str, list[Any]]]:
    """(sums SQL, args) for the groups `by` (dimensions) of a window, and with its `plan`
    (`Window.plan`) the (cells SQL, args) of each part of it, whose rows add up: `by` and the
    filters among HIST_DIMS then. The compacted hours' and blocks' parts first, each in `split`
    queries (the largest: a day's hours are 1.4 M rows at 10 M records, 0.85 s on one core), then
    the ranges of records: a store that runs them on two connections, each taking the next, ends
    both at about the same time."""
    first = window.first_block
    keys = ", ".join((*by, *(k for k in KINDS if k not in by)))
    filt, fargs = window.where()
    outer = ", ".join(f"{kind}({name})" for name, _, kind in SUMS)
    parts = [f"SELECT {keys}, {', '.join(name for name, _, _ in SUMS)} FROM llmproxy_rollup WHERE start >= ?{filt}"]
    args: list[Any] = [first, *fargs]
    if window.start_ns > 0 and not window.whole_blocks:
        parts.append(f"SELECT {keys}, {', '.join(expr for _, expr, _ in SUMS)} FROM llmproxy_records "
                     f"WHERE ended_ns >= ? AND ended_ns < ?{filt} GROUP BY {keys}")
        args += [window.start_ns, first, *fargs]
    out = [(dialect.sql(f"SELECT {keys}, {outer} FROM ({' UNION ALL '.join(parts)}) t GROUP BY {keys}"), args)]
    if plan is None:
        return out
    if not set(by) <= set(HIST_DIMS) or not {name for name, _ in window.filters} <= set(HIST_DIMS):
        raise ValueError(f"histograms are kept by {', '.join(HIST_DIMS)} only")
    hours, blocks, ranges = plan
    names = "".join(f"{key}, " for key in by)
    for span, every in ((C.HOUR_NS, hours), (BLOCK_NS, blocks)):
        for starts in (every[i::split] for i in range(split)):
            if starts:
                out.append((dialect.sql(f"SELECT {names}code, bucket, {dialect.counted} FROM {HISTS[span]} WHERE start IN ({', '.join('?' * len(starts))})"
                                        f"{filt} GROUP BY {names}code, bucket"), [*starts, *fargs]))
    for low, high in ranges:  # (a query each: a store may run them at once)
        out.append((dialect.sql(f"SELECT {names}code, bucket, {dialect.counted} FROM ({cells(dialect, by, f'ended_ns >= ? AND ended_ns < ?{filt}')}) t "
                                f"GROUP BY {names}code, bucket"), [low, high, *fargs]))
    return out


SAMPLED = -(1 << 63) + (1 << 60)  # keys below it: a sixteenth of the records, indexed apart (a busy model's sample)
BUSY = 20 * SAMPLE  # a model with this many points in the window has its sample read from the sixteenth


def sample(dialect: Dialect, fit: str) -> tuple[str, str]:
    """The two queries of a fit's sample (parameters: model, upstream, the window's start): the SAMPLE
    points with the lowest keys among the sixteenth (a busy model's: a sixteenth of its points in the
    window to read, by time), or among all its points (a quiet model's). The lowest keys overall
    either way, when the sixteenth holds SAMPLE of them: the same sample in every store."""
    x, y = f"{fit[0]}x", f"{fit[0]}y"
    text = f"SELECT key, {x}, {y} FROM llmproxy_records WHERE model = ? AND upstream = ? AND {x} IS NOT NULL AND ended_ns >= ?"
    return dialect.sql(f"{text} AND key < {SAMPLED} ORDER BY key LIMIT {SAMPLE}"), dialect.sql(f"{text} ORDER BY key LIMIT {SAMPLE}")


def units(ended: Iterable[int]) -> list[tuple[int, int]]:
    """The (span, start) of the blocks and hours these records (end times) count in: what a writer
    locks the shared side of, and a compaction the other, one unit each (PostgreSQL)."""
    return sorted({(span, end - end % span) for end in ended for span in (BLOCK_NS, C.HOUR_NS)})


def dirty(dialect: Dialect, ended: Iterable[int]) -> tuple[str, list[int]]:
    """The statement (and its arguments) that marks dirty the blocks and hours of these records (end times)
    that are compacted already: in the batch's transaction, under the compaction lock's shared side, a
    compaction either came before (its row is seen here) or waits for this batch. No clock is read: a
    replica whose clock is behind, a store that was down, an import, each marks exactly what it reaches."""
    pairs = units(ended)
    values = ", ".join(["(?, ?)"] * len(pairs))
    statement = (f"INSERT INTO llmproxy_dirty (span, start) SELECT span, start FROM llmproxy_compacted WHERE (span, start) IN "
                 f"(VALUES {values}) ON CONFLICT DO NOTHING")
    return dialect.sql(statement), [x for pair in pairs for x in pair]


def due(conn: Any, dialect: Dialect, now_ns: int, before_ns: int = INF_NS) -> list[tuple[int, int]]:
    """The (span, start) of every block and hour due for compaction (`DUE`, ending before `before_ns`), blocks first,
    each oldest first: read once per pass (it reads the rollup's blocks), then compacted one by one."""
    rows = conn.execute(dialect.sql(DUE), (now_ns - int(BLOCKS_KEPT_S * 1e9), min(now_ns - int(SETTLE_S * 1e9), before_ns))).fetchall()
    return [(int(span), int(start)) for span, start in rows]


def compact_unit(conn: Any, dialect: Dialect, transaction: Callable[[int, int], ContextManager[bool]], span: int, start: int,
                 now_ns: int) -> bool:
    """Compact one block or hour in one `transaction(span, start)`, on either store's connection: a block from its
    records; an hour from its blocks when they are kept and clean, else from its records. False: another connection
    is compacting it now (its transaction did not get the lock: it yields False) or did just now, so several
    connections compact at once (an import's end)."""
    with transaction(span, start) as mine:
        if not mine or conn.execute(dialect.sql(
                "SELECT 1 FROM llmproxy_compacted c WHERE c.span = ? AND c.start = ? AND NOT EXISTS "
                "(SELECT 1 FROM llmproxy_dirty d WHERE d.span = c.span AND d.start = c.start)"), (span, start)).fetchone():
            return False
        conn.execute(dialect.sql("DELETE FROM llmproxy_dirty WHERE span = ? AND start = ?"), (span, start))
        conn.execute(dialect.sql(f"DELETE FROM {HISTS[span]} WHERE start = ?"), (start,))
        if span == BLOCK_NS:
            statement = compact_block(dialect)
        else:
            missing = conn.execute(dialect.sql(
                f"SELECT count(*) FROM (SELECT DISTINCT start FROM llmproxy_rollup WHERE start >= ? AND start < ?) b "
                f"WHERE ({BLOCK_NS}, b.start) NOT IN (SELECT span, start FROM llmproxy_compacted) "
                f"OR ({BLOCK_NS}, b.start) IN (SELECT span, start FROM llmproxy_dirty)"), (start, start + span)).fetchone()[0]
            statement = compact_hour(dialect, from_blocks=missing == 0 and start >= now_ns - int(BLOCKS_KEPT_S * 1e9))
        conn.execute(statement, (start, start, start + span))
        conn.execute(dialect.sql("INSERT INTO llmproxy_compacted (span, start, at_ns) VALUES (?, ?, ?) "
                                 "ON CONFLICT (span, start) DO UPDATE SET at_ns = excluded.at_ns"), (span, start, now_ns))
    return True


def compact(conn: Any, dialect: Dialect, transaction: Callable[[int, int], ContextManager[bool]], now: Callable[[], int],
            before_ns: int = INF_NS, budget_s: float = math.inf) -> int:
    """Everything due compacted (within `budget_s`, each unit whole): how many units. Passes until none is due (a
    pass's hours may be compactable from its blocks only once they are)."""
    done, began = 0, time.monotonic()
    while time.monotonic() - began < budget_s:
        units = due(conn, dialect, now(), before_ns)
        progress = 0
        for span, start in units:
            if time.monotonic() - began >= budget_s:
                break
            progress += compact_unit(conn, dialect, transaction, span, start, now())
        done += progress
        if not units or not progress:
            break
    return done


# What a window may read from the histograms (parameters: its first block, the oldest block still kept): hours, and
# blocks whose histograms retention has not dropped (a block's are kept BLOCKS_KEPT_S: past that, hours only).
CLEAN = (f"SELECT span, start FROM llmproxy_compacted WHERE start >= ? AND (span = {C.HOUR_NS} OR start >= ?) "
         "AND (span, start) NOT IN (SELECT span, start FROM llmproxy_dirty)")


def kept_from(now_ns: int, by_day: bool = False) -> int:
    """The oldest block whose histograms a read may count on, by the store's clock (`now_ns`). PostgreSQL drops them
    by day (partitions.py): its oldest day kept may go at any moment, so the day after it, which stays a day at least.
    SQLite deletes them by time, in a pass a second, and a read is one snapshot: a minute's margin. (A day's margin on
    the reader's clock, before, sent a 24-hour window's first block to the records: 3.80 against 3.47 s, 181 against
    145 MB at 10 M records, bench/RESULTS.md.)"""
    if by_day:
        return ((now_ns - int(BLOCKS_KEPT_S * 1e9)) // C.DAY_NS + 1) * C.DAY_NS
    return now_ns - int(BLOCKS_KEPT_S * 1e9) + 60_000_000_000


def plan(window: Window, clean: Iterable[tuple[int, int]]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The window's plan from the rows CLEAN selected."""
    rows = list(clean)
    return window.plan((int(s) for span, s in rows if int(span) == C.HOUR_NS), (int(s) for span, s in rows if int(span) == BLOCK_NS))


def halved(plan: tuple[list[int], list[int], list[tuple[int, int]]], now_ns: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The plan with each range of records cut in two at its middle (up to now): a store with two
    connections reads the halves at once, one on each core (the last blocks of a busy day: 100,000
    records, 0.7 s on one)."""
    hours, blocks, ranges = plan
    cut: list[tuple[int, int]] = []
    for low, high in ranges:
        middle = (low + min(high, now_ns)) // 2
        cut += [(low, middle), (middle, high)] if low < middle < high else [(low, high)]
    return hours, blocks, cut


def sampled(conn: Any, dialect: Dialect, fit: str, model: str, upstream: str, points: int, window: Window) -> list[tuple[int, float, float]]:
    """One fit's sample of one model on one upstream that has `points` in the window (`sample`), on
    either store's connection."""
    busy, every = sample(dialect, fit)
    if points >= BUSY:
        rows = conn.execute(busy, (model, upstream, window.since_ns)).fetchall()
        if len(rows) >= SAMPLE:
            return rows
    return conn.execute(every, (model, upstream, window.since_ns)).fetchall()
