"""What one record is in a store besides its JSON: typed columns, and the figures read from them.

One definition, written by both stores (`sqlite.py`, `postgres.py`) and read by `aggregate.py`:

- **columns** (`COLUMNS`, `values`): what the list's filters and the fits' samples read (TTFT,
  end to end, the verdict, the fits' points), and every figure a percentile is read of: each phase,
  prompt and output tokens, decode tok/s, the concurrency a stream began decoding at; the record's
  `series` (a hash of what it is counted by: instance, model, upstream, API, endpoint, outcome,
  objective, verdict, what an SLO miss blamed, and its tenant) and `key` (a hash of its id: the sample's order,
  and with the end time the key that stores it once).
- **figures** (`FIGURES`): each a code, the records it is read over (its population) and an SQL
  expression of the columns. A figure's value counts in a logarithmic bucket of ratio `GAMMA`, so
  that any value lies within 1% of its bucket's geometric middle; the concurrency levels are
  counted by value. The stores count (code, bucket) pairs with this SQL, over the
  records of an hour when they compact it and over the rest of a window when it is read; Python
  only reads the counts back.

Each figure's population is what `explain` has always read: phases, tokens and model load over the
successful requests; decode speed, engine queue and concurrency levels over the successful streams.
The codes are stored: never renumber one, only add (and a phase added later is a column added by a
schema migration).
"""
from __future__ import annotations

import collections
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import orjson

from ..measure.buckets import DURATION_BUCKETS, TTFT_BUCKETS
from ..measure.labels import ModelLabels, served
from ..wire.text import storable
from . import codec

GAMMA = 1.02  # bucket ratio: a value is within sqrt(GAMMA) - 1 = 0.995% of its bucket's middle
LN_GAMMA = math.log(GAMMA)
ZERO = -(1 << 19)  # the bucket of 0 (and of anything below 1e-300, which no duration is)
INT_MAX = (1 << 63) - 1  # a bigint column's (both stores)
REAL_MAX = 1.7976931348623157e308  # a finite double's
MAX_DURATION_S = 10 * 86400.0  # a request longer than this is no request's record
SKEW_AHEAD_S = 3600  # how far after the writer's clock a record may end (`skew`)
# The figures `values` reads into typed columns, checked first (`check`): the reals, and the counts (integers, never negative).
CHECKED_REALS = ("ttft_s", "decode_tokens_per_second")
CHECKED_COUNTS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "hidden_reasoning_tokens", "in_flight_at_decode")
HOUR_NS = 3600 * 1_000_000_000
DAY_NS = 24 * HOUR_NS

PHASES = ("client", "proxy", "network", "tokenize", "queue", "load", "reasoning", "prefill", "decode", "server", "wait",
          "failover", "lag")  # (appended: codes stay)
PHASE_CODES = {name: code for code, name in enumerate(PHASES, start=1)}  # 1-31
OUTPUT, PROMPT, LOAD, QUEUE, DECODE_TPS, DECODE_ITL, LEVEL, CACHED = range(32, 40)  # (40: reserved)
EXACT = frozenset({LEVEL})  # counted by value, not in a log bucket (64-67: reserved)

# The typed columns, in the order `values` gives them (the stores' schemas declare them in this order).
# What `series` hashes. `blame`: an SLO miss's objectives and the phase each blamed ("tpot=decode;ttft=prefill"),
# few distinct, so the misses by blamed phase are counted exactly with the rest.
# `tenant` (tenants.py: few) is a dimension; the end user (many) is only a column the list filters on.
DIMENSIONS = ("instance", "model", "upstream", "api", "endpoint", "outcome", "slo", "verdict", "blame", "tenant")
REALS = ("ttft_s", "duration_s", "decode_tps", *(f"ph_{p}" for p in PHASES), "px", "py", "dx", "dy")
INTEGERS = ("completion", "prompt", "output", "in_flight")
# `model_name`: the record's own model where the aggregates fold it into `other` (Models), else null: the list's filter reads it.
TEXTS = ("user_id", "model_name")  # (not `user`: a reserved word in PostgreSQL)
COLUMNS = ("rid", "key", "ended_ns", "received_ns", "series", *DIMENSIONS, *REALS, *INTEGERS, *TEXTS)

OK = "outcome = 'ok'"
STREAM = "outcome = 'ok' AND ttft_s IS NOT NULL"


@dataclass(frozen=True)
class Figure:
    code: int
    where: str  # the records it is read over (SQL)
    value: str  # SQL over the columns: a value (log-bucketed), or for an exact figure its bucket


FIGURES = (
    *(Figure(PHASE_CODES[p], f"{OK} AND ph_{p} IS NOT NULL", f"ph_{p}") for p in PHASES),
    Figure(OUTPUT, f"{OK} AND output IS NOT NULL", "output"),
    Figure(PROMPT, OK, "coalesce(prompt, 0)"),
    Figure(LOAD, f"{OK} AND ph_load > 0", "ph_load"),
    Figure(QUEUE, f"{STREAM} AND ph_queue IS NOT NULL", "ph_queue"),
    Figure(DECODE_TPS, f"{STREAM} AND decode_tps > 0", "decode_tps"),
    Figure(DECODE_ITL, "dy IS NOT NULL", "dy"),
    Figure(LEVEL, f"{STREAM} AND decode_tps > 0 AND in_flight > 0", "in_flight"),
    Figure(CACHED, "px IS NOT NULL AND prompt IS NOT NULL", "prompt - px"),  # the prefill fit's points' cached tokens (hours compacted since)
)


def bucket_sql(value: str) -> str:
    """A value's log bucket, in SQL (both stores' ln and floor are the C library's, as Python's are)."""
    return f"CASE WHEN {value} > 1e-300 THEN CAST(floor(ln({value}) / {LN_GAMMA!r}) AS INTEGER) ELSE {ZERO} END"


def bucket(value: float) -> int:
    return math.floor(math.log(value) / LN_GAMMA) if value > 1e-300 else ZERO


def middle(index: int) -> float:
    """The value a bucket stands for: its geometric middle (0 for the zero bucket)."""
    return 0.0 if index == ZERO else GAMMA ** (index + 0.5)


# The live summary's coarse histograms (rollup columns): the Prometheus histograms' own buckets.
SUMMARY_BOUNDS = {"ttft": TTFT_BUCKETS, "e2e": DURATION_BUCKETS}
SUMMARY_VALUES = {"ttft": "ttft_s", "e2e": "duration_s"}


def _hash(text: str) -> int:
    """A signed 64-bit hash (a bigint column in both stores)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big", signed=True)


@functools.lru_cache(maxsize=4096)
def series(dims: tuple[str, ...]) -> int:
    """The series of a record's dimensions (few: remembered)."""
    return _hash("\x00".join(dims))


def ended_ns(record: dict[str, Any]) -> int:
    """When the request ended, on the wall clock: its own time bucket wherever it is written. ValueError: no valid end
    time (a duration that is no number, negative or over MAX_DURATION_S; a start that is no epoch time in ns)."""
    received, duration = record["received_unix_ns"], record["duration_s"]
    if type(received) is not int or not 0 <= received <= INT_MAX or isinstance(duration, bool) or not isinstance(duration, (int, float)) \
            or not 0.0 <= duration <= MAX_DURATION_S:  # (NaN fails every comparison)
        raise ValueError(f"no valid end time (received_unix_ns {str(received)[:32]}, duration_s {str(duration)[:32]})")
    ended = received + round(duration * 1e9)
    if ended > INT_MAX:
        raise ValueError(f"no valid end time (received_unix_ns {received} and duration_s {duration} end past a bigint)")
    return ended


def skew(ended: int, now_ns: int, max_age_s: float) -> bool:
    """Whether a record's end lies outside what a store keeps: before its retention (`max_age_s`; 0: none), or more than
    SKEW_AHEAD_S after the writer's clock. Such a record is dropped (`clock_skew`): written, it would be deleted at the
    next pass, or make a partition for a day no proxy has reached."""
    return ended > now_ns + SKEW_AHEAD_S * 1_000_000_000 or (max_age_s > 0 and ended < now_ns - int(max_age_s * 1e9))


def check(record: dict[str, Any]) -> list[str]:
    """Every figure of a record that a store keeps in a typed column, checked where it is read: one the column cannot
    hold (NaN, an infinity, a count below zero or past a bigint) is set to null in the record, its name returned (the
    record is kept; the writer counts them). The proxy's own records never hold one (their sources are checked:
    chunk.count, engine.py); an imported file, or another version's writer, might."""
    nulled = []
    get = record.get
    for name in CHECKED_REALS:
        value = get(name)
        if value is not None and not _real(value):
            record[name] = None
            nulled.append(name)
    for name in CHECKED_COUNTS:
        value = get(name)
        if value is not None and not _count(value):
            record[name] = None
            nulled.append(name)
    phases = get("phases_s")
    if isinstance(phases, dict):
        for name, value in list(phases.items()):
            if value is not None and not _real(value):
                del phases[name]
                nulled.append("phases_s")
    elif phases is not None:
        record["phases_s"] = {}
        nulled.append("phases_s")
    return nulled


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -REAL_MAX <= value <= REAL_MAX  # (NaN: False)


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= INT_MAX


def verdict(record: dict[str, Any]) -> str:
    good = record.get("slo_good")
    return "" if good is None else "good" if good else "miss"


def prefill_point(record: dict[str, Any]) -> tuple[float, float] | None:
    """(uncached prompt tokens, prefill seconds) of a successful stream: the prefill fit's point."""
    phases = record.get("phases_s") or {}
    if record["outcome"] != "ok" or record.get("ttft_s") is None or record.get("prompt_tokens") is None or "prefill" not in phases:
        return None
    return float(record["prompt_tokens"] - (record.get("cached_prompt_tokens") or 0)), float(phases["prefill"])


def decode_point(record: dict[str, Any]) -> tuple[float, float] | None:
    """(requests in flight when it began decoding, seconds per token): the decode fit's point. A slow
    client's held-back stream runs at the client's pace, not the engine's: left out."""
    tps = record.get("decode_tokens_per_second")
    if (record["outcome"] != "ok" or record.get("ttft_s") is None or not tps or not record.get("in_flight_at_decode")
            or record.get("unmeasured") == "client_backpressure"):
        return None
    return float(record["in_flight_at_decode"]), 1.0 / tps


class Columns:
    """What a writer makes of its records: each one's figures checked (`check`, what it nulled counted in `nulled` until
    the writer takes it), its typed columns (`values`, the model folded for the aggregates by `models`) and its
    compressed JSON (re-serialised only when a figure was nulled).

    The aggregates keep model names as the metrics do, by the same rule (labels.ModelLabels): the configuration's
    names (`known`: its routes' and objectives' exact names) always, then the first `max_models` others no upstream
    refused; the rest count as `other` there (names are the client's: random ones would grow the rollup without
    bound). A record always keeps its own name (`values`: its `model_name` column when folded)."""

    def __init__(self, max_models: int = 100, known: tuple[str, ...] = ()) -> None:
        self.models = ModelLabels(max_models)
        self.models.know(known)
        self.nulled: collections.Counter[str] = collections.Counter()

    def row(self, rid: str, record: dict[str, Any], data: bytes | None = None) -> tuple[Any, ...]:
        """A record's columns and its stored JSON (`data`: as it came, when nothing is nulled)."""
        nulled = check(record)
        if nulled:
            self.nulled.update(nulled)
            data = None
        return (*values(rid, record, self.models), codec.pack(data if data is not None else orjson.dumps(record)))

    def take_nulled(self) -> dict[str, int]:
        taken, self.nulled = dict(self.nulled), collections.Counter()
        return taken


def _text(value: Any, limit: int = 256) -> str:
    return storable(value if isinstance(value, str) else str(value), limit)


def values(rid: str, record: dict[str, Any], models: ModelLabels | None = None) -> tuple[Any, ...]:
    """The typed columns of one record, in `COLUMNS` order, every text storable (an imported record's
    too: text.py), the model folded past the writer's cap for the aggregates (and kept in `model_name`).
    Its figures were checked (`check`, `Columns.row`). (The hot part of an import: written for speed.)"""
    get = record.get
    rid = _text(rid, 1024)
    received = int(record["received_unix_ns"])
    duration = float(record["duration_s"])
    good = get("slo_good")
    blame = get("slo_blame")
    model = _text(record["model"])
    folded = models(model, served(int(get("status_code") or 0))) if models is not None else model
    dims = (_text(get("instance") or ""), folded, _text(get("upstream") or ""),
            _text(get("api") or "other"), _text(get("endpoint") or "other"), _text(record["outcome"]), _text(get("slo") or ""),
            "" if good is None else "good" if good else "miss",
            _text(";".join(f"{missed}={blamed}" for missed, blamed in sorted(blame.items())) if blame else ""), _text(get("tenant") or "unknown"))
    phases = get("phases_s") or {}
    completion = get("completion_tokens")
    ttft, tps = get("ttft_s"), get("decode_tokens_per_second")
    return (rid, _hash(rid), received + round(duration * 1e9), received, series(dims), *dims,
            None if ttft is None else float(ttft), duration, None if tps is None else float(tps),
            *[None if (v := phases.get(p)) is None else float(v) for p in PHASES], *(prefill_point(record) or (None, None)),
            *(decode_point(record) or (None, None)), int(completion or 0), get("prompt_tokens"),
            completion - (get("hidden_reasoning_tokens") or 0) if completion else None, get("in_flight_at_decode"),
            _text(get("user")) if get("user") else None, model if folded != model else None)
