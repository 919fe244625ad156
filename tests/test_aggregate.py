"""`explain` from the store's aggregates gives the answers it gave when it read every record: the same
fixed set of a fleet's records through today's code (tests/explain_reference.py: every record loaded
and read in Python) and through a store (counted by its SQL), compared figure by figure: counts and
SLO verdicts exact, fits within 1% (the same points: a group holds under 300 of them), percentiles
within 1% (the log buckets' bound), figures derived from several percentiles within their sum.

Both of a store's read paths are held to it: a window read from the records themselves, and the same
window once its hours are compacted into histograms; and a window whose start falls inside an hour
(its first partial hour from the records, the rest from the aggregates) against the oracle on the
records that ended inside it."""
from __future__ import annotations

import time
from typing import Any

import pytest

import explain_reference as reference
import fleet
from proxy.answers import budget
from proxy.answers.explain import explain, gather, of_records
from proxy.records import Backend
from proxy.records.aggregate import read
from proxy.records import sql
from proxy.records.sql import Window
from proxy.records import columns as C

HOUR_NS = C.HOUR_NS
COUNTS = {"requests", "ok", "streams", "n", "judged", "good", "bad", "levels", "peak_streams", "requests"}
EXACT = {"attainment", "budget_left", "goodput_rps", "throughput_rps", "window_s", "aggregate_output_tps", "max_s", "target", "tpot_s"}
DERIVED = {"share", "crossover_prompt_tokens", "streams", "headroom"}  # several percentiles (or a fit and a percentile) in one figure


def fixed_set(n: int = 1200, hours: float = 6.0) -> list[dict[str, Any]]:
    """The fixed set: 20 models (no group over 300 fit points), 4 replicas, every outcome, verdicts and
    blame, ending over the last `hours` (so that whole hours can be compacted)."""
    end = (time.time_ns() // HOUR_NS - 1) * HOUR_NS  # (ended an hour ago and more: every hour may be compacted)
    return list(fleet.records(n, end - int(hours * 3600e9), hours * 3600, models=20, instances=4, seed=11))


def differences(new: Any, old: Any, path: str = "") -> list[str]:
    """Where the two reports disagree beyond what each kind of figure may (`limit`)."""
    if isinstance(old, dict):
        out = [f"{path}/{key}: missing" for key in (set(old) ^ set(new)) - {"method"}]
        return out + [d for key in old if key in new for d in differences(new[key], old[key], f"{path}/{key}")]
    if isinstance(old, list):
        return [d for i, (a, b) in enumerate(zip(new, old)) for d in differences(a, b, f"{path}[{i}]")] if len(new) == len(old) else [f"{path}: length"]
    if isinstance(old, bool) or not isinstance(old, (int, float)):
        return [] if new == old or "/diagnosis" in path else [f"{path}: {new!r} != {old!r}"]  # (the diagnosis: its numbers, rounded)
    bound = limit(path.split("/")[1:])
    return [] if abs(new - old) <= bound * abs(old) + 1e-12 else [f"{path}: {new!r} vs {old!r} ({(new - old) / old if old else new:+.2%})"]


def limit(keys: list[str]) -> float:
    """The relative difference a figure may show: 0 for a count, float rounding for what is summed or
    fitted from the same points, a bucket (1%) for a percentile, the sum of a few for a derived one."""
    leaf = keys[-1]
    if leaf in COUNTS or "apis" in keys or "misses" in keys:
        return 0.0
    if leaf in EXACT or "objectives" in keys or "prefill" in keys[1:2] or ("decode" in keys[1:2] and leaf in ("intercept", "slope", "r2")):
        return 1e-9
    if leaf in DERIVED:
        return 0.03
    return 0.01 + 1e-9


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return fixed_set()


@pytest.fixture(scope="module")
def store(records: list[dict[str, Any]]) -> Backend:
    return of_records(records)


def oracle(records: list[dict[str, Any]]) -> dict[str, Any]:
    return reference.explain(records, objectives=fleet.OBJECTIVES)


def test_the_fixed_set_is_what_it_claims(records):
    fits = {}
    for r in records:
        if C.prefill_point(r):
            fits[r["model"]] = fits.get(r["model"], 0) + 1
    assert len({r["model"] for r in records}) == 20 and len({r["instance"] for r in records}) == 4
    assert max(fits.values()) < 300 and {r["outcome"] for r in records} == {"ok", "upstream_error", "client_disconnect", "timeout"}
    assert {m for r in records for m in (r.get("slo_blame") or {})} >= {"ttft", "tpot", "error"}


def test_the_store_answers_as_every_record_did(records, store):
    old, new = oracle(records), explain(gather([store]), objectives=fleet.OBJECTIVES)
    assert sorted(new) == sorted(old)
    assert differences(new, old) == []
    summaries = budget.summary(read([store], ("slo",), Window(), histograms=False).values(), fleet.OBJECTIVES)
    assert differences(summaries, reference.summary(records, fleet.OBJECTIVES)) == []


def test_compacted_hours_answer_as_the_records_do(records):
    store = of_records(records)
    before = explain(gather([store]), objectives=fleet.OBJECTIVES)
    store.open()
    try:
        assert store.compact() >= 6  # every hour the set spans
    finally:
        store.close()
    after = explain(gather([store]), objectives=fleet.OBJECTIVES)
    assert differences(after, before) == [] and after.keys() == before.keys()
    late = {**records[5], "id": "late-1"}  # a record reaching a compacted hour: the hour is counted again
    store.open()
    try:
        store.write([store_row(late)])
        assert store.compact() == 2  # (its block, and its hour)
    finally:
        store.close()
    again = explain(gather([store]), objectives=fleet.OBJECTIVES)
    name = f"{late['model']} @ {late['upstream']}"
    assert again[name]["requests"] == before[name]["requests"] + 1
    assert differences(again, oracle(records + [late])) == []


def store_row(record: dict[str, Any]) -> Any:
    import orjson

    from proxy.records import Writer

    return Writer.row(orjson.dumps(record))


def compacted(records: list[dict[str, Any]]) -> Backend:
    """The records in a store, every block and hour of theirs compacted."""
    store = of_records(records)
    store.open()
    try:
        store.compact()
    finally:
        store.close()
    return store


def answers_as_every_record_since(store: Backend, window: Window, since_ns: int, records: list[dict[str, Any]]) -> None:
    """The window's explain counts every record that ended since `since_ns`, and answers as they did."""
    inside = [r for r in records if C.ended_ns(r) >= since_ns]
    new = explain(gather([store], window), objectives=fleet.OBJECTIVES)
    assert sum(g["requests"] for g in new.values()) == len(inside)
    assert differences(new, oracle(inside)) == []


def test_a_window_starting_inside_an_hour(records):
    """--since: its first partial hour read from the records, the rest from the aggregates (compacted)."""
    store = compacted(records)
    start = max(C.ended_ns(r) for r in records) - int(2.5 * 3600e9)  # two and a half hours before the last: half an hour in
    assert start % HOUR_NS != 0
    window = Window(start)
    answers_as_every_record_since(store, window, start, records)


def test_a_window_of_whole_blocks_answers_from_its_first_block(records):
    """`explain --since`: from the start of the ten-minute block the start falls in, the blocks read
    from the aggregates (compacted) and only the last ones from the records: the answer over every
    record since that block's start."""
    store = compacted(records)
    start = max(C.ended_ns(r) for r in records) - int(2.5 * 3600e9) + 123_456_789
    window = Window(start, whole_blocks=True)
    assert window.since_ns < start and window.since_ns % sql.BLOCK_NS == 0
    assert len([r for r in records if C.ended_ns(r) >= window.since_ns]) > len([r for r in records if C.ended_ns(r) >= start])  # (the block's head is in)
    answers_as_every_record_since(store, window, window.since_ns, records)


def test_percentiles_are_within_one_bucket_of_the_value():
    from proxy.records.aggregate import Aggregate

    agg = Aggregate()
    values = [0.001 * 1.37 ** k for k in range(40)]
    for v in values:
        agg.add_cell(C.PHASE_CODES["prefill"], C.bucket(v), 1)
    ordered = sorted(values)
    for q in (0.0, 0.25, 0.5, 0.9, 1.0):
        position = q * (len(ordered) - 1)
        low = int(position)
        truth = ordered[low] + (ordered[min(low + 1, len(ordered) - 1)] - ordered[low]) * (position - low)
        assert agg.quantile(C.PHASE_CODES["prefill"], q) == pytest.approx(truth, rel=C.GAMMA ** 0.5 - 1 + 1e-9)
    assert agg.quantile(C.PHASE_CODES["prefill"], 0.5, zeros=100) == 0.0  # (a phase most records lack: its median is 0)


def test_a_busy_models_sample_is_the_one_a_full_scan_finds(records, store, monkeypatch):
    """A fit's sample is the points with the lowest keys: read from the sixteenth of the records indexed
    by key when that holds enough of them (a busy model), else from all of its points; the same points
    either way (so every store, and every path, samples alike)."""
    import sqlite3

    from proxy.records import sql

    monkeypatch.setattr(sql, "SAMPLE", 5)  # (a busy model: one whose sixteenth holds 5 points)
    monkeypatch.setattr(sql, "BUSY", 0)
    model, upstream = max(((r["model"], r["upstream"]) for r in records), key=lambda g: sum(1 for r in records if (r["model"], r["upstream"]) == g))
    db = sqlite3.connect(f"file:{store.where}?mode=ro", uri=True)
    busy, every = sql.sample(sql.SQLITE, "prefill")
    assert len(db.execute(busy, (model, upstream, 0)).fetchall()) == 5  # (the busy path is the one taken)
    assert sql.sampled(db, sql.SQLITE, "prefill", model, upstream, 10**6, Window()) == db.execute(every, (model, upstream, 0)).fetchall()
    quiet = sorted(((r["model"], r["upstream"]) for r in records), key=lambda g: sum(1 for r in records if (r["model"], r["upstream"]) == g))[0]
    assert len(db.execute(busy, (*quiet, 0)).fetchall()) < 5
    assert sql.sampled(db, sql.SQLITE, "prefill", *quiet, 10**6, Window()) == db.execute(every, (*quiet, 0)).fetchall()


def test_a_days_window_reads_its_first_block_from_the_histograms_and_never_a_dropped_one():
    """PostgreSQL drops the ten-minute histograms by day, once all of a day is older than BLOCKS_KEPT_S
    (partitions.expired). What a read counts on (sql.kept_from, by the store's clock) must never include a day that a
    drop may take while it reads, and must reach back far enough for a 24-hour window's first block (a day's margin
    on the reader's clock, before, sent it to the raw records every time)."""
    import random

    from proxy.records import columns as C
    from proxy.records.sql import BLOCK_NS, BLOCKS_KEPT_S, kept_from

    rng = random.Random(3)
    covered = 0
    for _ in range(2000):
        now = 1_760_000_000_000_000_000 + rng.randrange(30 * C.DAY_NS)
        oldest_kept_day = (now - int(BLOCKS_KEPT_S * 1e9)) // C.DAY_NS  # (days before it are dropped; it may go at any moment)
        assert kept_from(now, by_day=True) >= (oldest_kept_day + 1) * C.DAY_NS
        covered += (now - C.DAY_NS) // BLOCK_NS * BLOCK_NS >= kept_from(now, by_day=True)
    assert covered >= 0.98 * 2000, covered  # (missed only in the ten minutes after the store's day begins: the block straddles)
