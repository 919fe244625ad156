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

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from ..buckets import DURATION_BUCKETS, TTFT_BUCKETS
from ..text import storable

GAMMA = 1.02  # bucket ratio: a value is within sqrt(GAMMA) - 1 = 0.995% of its bucket's middle
LN_GAMMA = math.log(GAMMA)
ZERO = -(1 << 19)  # the bucket of 0 (and of anything below 1e-300, which no duration is)
HOUR_NS = 3600 * 1_000_000_000
DAY_NS = 24 * HOUR_NS

PHASES = ("client", "proxy", "network", "tokenize", "queue", "load", "reasoning", "prefill", "decode", "server", "wait",
          "failover")  # (appended: codes stay)
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
TEXTS = ("user_id",)  # (not `user`: a reserved word in PostgreSQL)
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
    """When the request ended, on the wall clock: its own time bucket wherever it is written."""
    return int(record["received_unix_ns"]) + round(float(record["duration_s"]) * 1e9)


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


class Models:
    """The model names a writer's aggregates keep by name: the first `cap` it sees; the rest count as
    `other` there (their records keep their names), as the metrics fold them (labels.py): names are
    the client's, and random ones would grow the rollup without bound."""

    def __init__(self, cap: int = 100) -> None:
        self.cap, self.seen = cap, set[str]()

    def __call__(self, model: str) -> str:
        if model in self.seen:
            return model
        if len(self.seen) >= self.cap:
            return "other"
        self.seen.add(model)
        return model


def _text(value: Any, limit: int = 256) -> str:
    return storable(value if isinstance(value, str) else str(value), limit)


def values(rid: str, record: dict[str, Any], models: Models | None = None) -> tuple[Any, ...]:
    """The typed columns of one record, in `COLUMNS` order, every text storable (an imported record's
    too: text.py), the model folded past the writer's cap. (The hot part of an import: written for speed.)"""
    get = record.get
    rid = _text(rid, 1024)
    received = int(record["received_unix_ns"])
    duration = float(record["duration_s"])
    good = get("slo_good")
    blame = get("slo_blame")
    model = _text(record["model"])
    dims = (_text(get("instance") or ""), models(model) if models is not None else model, _text(get("upstream") or ""),
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
            _text(get("user")) if get("user") else None)
