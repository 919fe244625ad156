"""Durable per-request records, written off the request path: one bounded buffer and one writer
thread per process, in front of one of two stores behind one small interface (`Backend`):

- `sqlite.py`: an embedded file (the default, `records-PORT.sqlite`): one command, no server;
- `postgres.py`: `--records-db postgresql://…`, one store for every replica of a fleet.

Why records at all: Prometheus histograms lose the joint distribution (prompt length, output
length, concurrency and timings of one request), which `explain` needs. The finisher hands each
finished record to `Writer.add` (serialised once, appended to the buffer: no I/O, no lock held for
long); the writer thread takes batches of up to `BATCH`, at most `FLUSH_S` old, and writes each in
one transaction. When the store is down, slow or refusing, the batch goes back to the front of the
buffer and the writer retries with a growing pause (`RETRY_S`): requests never wait on it. The
buffer holds at most `--records-buffer` records and `--records-buffer-bytes` bytes (one batch in
flight besides); past either cap the oldest records are dropped and counted
(`llmproxy_records_dropped_total{reason="buffer_full"}`), as are a batch the store refuses for what
it holds (`rejected`) and what is left when `close` runs out of time at shutdown (`shutdown`).
Records hold timings and counts only: no credential, no prompt or completion text.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import math
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import orjson

from .sql import Window
from .columns import ended_ns

log = logging.getLogger("llmproxy.records")

BATCH = 500  # rows per transaction at most
FLUSH_S = 0.25  # how long a record may wait for its batch
RETRY_S = (0.2, 5.0)  # the pause after a failure, doubling from the first to the second
DROP_REASONS = ("buffer_full", "rejected", "shutdown")


class Unavailable(Exception):
    """The store cannot take rows now (down, locked, slow): keep them and try again."""


class Rejected(Exception):
    """The store refuses these rows for what they hold: trying again cannot help (dropped, counted)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One record on its way to a store: its JSON (which holds its `id`), and what orders and keys it.
    The store computes the typed columns and cells from the JSON (columns.py), on the writer thread."""

    rid: str  # the record's stable id: instance/pid/boot/seq for the proxy's own, or an imported record's `id`
    ended_ns: int  # when the request ended (wall clock, epoch ns): its partition and its hour in the aggregates
    data: bytes
    seq: int
    record: dict[str, Any] | None = None  # the JSON already parsed (an import's: not parsed twice); else the store parses it

    def parsed(self) -> dict[str, Any]:
        return self.record if self.record is not None else orjson.loads(self.data)


@dataclass(frozen=True)
class Filters:
    """What /llmproxy/requests (and /ui) may select by; empty: any. `verdict`: good or miss; `min_ttft`:
    seconds (0: any)."""

    model: str = ""
    upstream: str = ""
    outcome: str = ""
    api: str = ""
    slo: str = ""
    verdict: str = ""
    instance: str = ""
    min_ttft: float = 0.0
    tenant: str = ""
    user: str = ""  # the end user: a column of the records, not a dimension (the aggregates never see it)

    def equal(self) -> list[tuple[str, str]]:
        """(column, wanted value) for every filter that is an equality on a dimension (columns.DIMENSIONS)."""
        return [(name, value) for name in ("model", "upstream", "outcome", "api", "slo", "verdict", "instance", "tenant")
                if (value := getattr(self, name))]

    def match(self, record: dict[str, Any]) -> bool:
        """The same selection on a record in memory (records off)."""
        return all(record.get(name) == want for name, want in self.equal() if name != "verdict") \
            and (not self.user or record.get("user") == self.user) \
            and (not self.verdict or record.get("slo_good") is (self.verdict == "good")) \
            and (not self.min_ttft or (record.get("ttft_s") or 0.0) >= self.min_ttft)


class Backend(Protocol):
    """One store. `open`, `write`, `retain` and `close` run on the writer thread only; the readers on
    any thread, each with a connection of its own."""

    where: str  # for log lines: a path, or a URL with no password
    retain_every_s: float  # how often the writer runs `retain`, busy or idle

    def open(self) -> None: ...  # connect and migrate; Unavailable if it cannot now

    def write(self, rows: list[Row]) -> int: ...  # one transaction, with the aggregates: how many were new; Unavailable or Rejected

    def retain(self) -> None: ...  # retention, partitions ahead, and moving an older schema's records in

    def close(self) -> None: ...

    def recent(self, limit: int, filters: Filters) -> list[bytes]: ...  # the newest records' JSON, oldest first

    def aggregate(self, by: tuple[str, ...], window: Window, cells: bool = True) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]: ...
    # (aggregate.queries: the sums' rows and, with `cells`, the histograms' rows)

    def compact(self, before_ns: int = 1 << 62) -> int: ...  # on the writer's connection: what is due (ending before that) compacted now

    def samples(self, wanted: list[tuple[str, str, str, int]], window: Window) -> list[list[tuple[int, float, float]]]: ...
    # (each (fit, model, upstream, its points in the window)'s sample: (key, x, y), on one connection)

    def export(self, start_ns: int) -> Iterator[bytes]: ...  # every record's JSON since start_ns, oldest first

    def pending(self) -> int: ...  # records of an older schema not moved in yet


class Writer:
    """The bounded buffer and its writer thread, in front of one backend."""

    def __init__(self, backend: Backend, instance: str, max_records: int, max_bytes: int, on_error: Callable[[], None],
                 on_drop: Callable[[str, int], None], on_batch: Callable[[int, int], None] | None = None, batch: int = BATCH,
                 retain: bool = True) -> None:
        """`on_drop(reason, count)`; `on_batch(written, buffered)` after each batch (the metrics);
        `batch`: rows per transaction at most; without `retain`, no retention or compaction pass (an
        import, which compacts once at its end)."""
        self.backend, self.instance = backend, instance
        self.max_records, self.max_bytes = max(1, max_records), max(1, max_bytes)
        self.on_error, self.on_drop, self.on_batch = on_error, on_drop, on_batch
        self.batch = max(1, batch)
        self.retain_every_s = backend.retain_every_s if retain else math.inf
        self.written = 0
        self.connected = False
        self._buffer: collections.deque[Row] = collections.deque()
        self._bytes = 0
        self._in_flight: list[Row] = []
        self._seq = itertools.count(1)
        self._last = 0  # the newest seq added
        self._boot = f"{os.getpid()}/{time.time_ns()}"
        self._urgent = False  # a flush is waiting: write now, do not wait for a fuller batch
        self._stopping = False
        self._deadline = 0.0
        self._down_since = 0.0  # when the store last became unreachable (0: it is reachable)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="llmproxy-records", daemon=True)
        self._thread.start()

    def add(self, record: dict[str, Any]) -> None:
        """The only call on the request side: name the record (its stable `id`), serialise it, append,
        drop the oldest past the caps."""
        seq = next(self._seq)
        record["id"] = rid = f"{self.instance}/{self._boot}/{seq}"
        self._append(Row(rid, ended_ns(record), orjson.dumps(record), seq), block=False)

    def put_row(self, row: Row) -> None:
        """An exported record (`row`) through the same path, for `records import`: a full buffer makes
        the caller wait instead of dropping."""
        self._append(Row(row.rid, row.ended_ns, row.data, next(self._seq), row.record), block=True)

    @staticmethod
    def row(line: bytes, seq: int = 0) -> Row:
        """An exported record's row: it keeps its own `id` (one without is named by its content, so a
        second import skips it too) and its own end time. Rejected: not a record."""
        try:
            record = orjson.loads(line)
            rid = record.get("id") or ""
            if not rid:
                record["id"] = rid = "import/" + hashlib.sha256(line.strip()).hexdigest()[:32]
                line = orjson.dumps(record)
            return Row(str(rid), ended_ns(record), line.strip(), seq, record)
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            raise Rejected(f"not a record: {exc}") from None

    def _append(self, row: Row, block: bool) -> None:
        with self._cond:
            while block and not self._stopping and (len(self._buffer) >= self.max_records or self._bytes >= self.max_bytes):
                self._cond.wait(1.0)
            self._buffer.append(row)
            self._last = row.seq
            self._bytes += len(row.data)
            self._enforce_caps()
            if len(self._buffer) == 1 or len(self._buffer) >= self.batch:  # the writer waits for a first row, or a full batch
                self._cond.notify_all()

    def _enforce_caps(self) -> None:
        dropped = 0
        while self._buffer and (len(self._buffer) > self.max_records or self._bytes > self.max_bytes):
            self._bytes -= len(self._buffer.popleft().data)
            dropped += 1
        if dropped:
            self.on_drop("buffer_full", dropped)

    @property
    def down_s(self) -> float:
        """How long the store has been unreachable (0: it is not)."""
        return time.monotonic() - self._down_since if self._down_since and not self.connected else 0.0

    @property
    def buffered(self) -> int:
        return len(self._buffer) + len(self._in_flight)

    def flush(self, timeout: float = 2.0) -> None:
        """Until every record added so far is written or dropped (a read after it sees them), for
        at most `timeout`; at once when the store is unreachable (the reader falls back)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._last
            self._urgent = True
            self._cond.notify_all()
            while self._pending(target) and time.monotonic() < deadline and not (self._down_since and not self.connected):
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._urgent = False

    def _pending(self, seq: int) -> bool:
        return bool((self._in_flight and self._in_flight[0].seq <= seq) or (self._buffer and self._buffer[0].seq <= seq))

    def close(self, timeout: float = 5.0) -> None:
        """Write what is buffered within `timeout` (the server's shutdown), drop and count the rest, stop."""
        with self._cond:
            self._stopping, self._deadline = True, time.monotonic() + timeout
            self._cond.notify_all()
        self._thread.join(timeout + 1.0)

    def recent(self, limit: int, filters: Filters) -> list[bytes]:
        return self.backend.recent(limit, filters)

    def _take(self) -> list[Row] | None:
        """The next batch (None: stop). Waits for a first row, then up to FLUSH_S for a fuller batch."""
        with self._cond:
            while not self._buffer and not self._stopping:
                self._cond.wait(1.0 if self.retain_every_s else None)
                if not self._buffer and self.retain_every_s:
                    return []  # idle: a chance to retain
            if not self._buffer:
                return None
            deadline = time.monotonic() + FLUSH_S
            while not (self._stopping or self._urgent) and len(self._buffer) < self.batch and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            batch = [self._buffer.popleft() for _ in range(min(self.batch, len(self._buffer)))]
            self._bytes -= sum(len(row.data) for row in batch)
            self._in_flight = batch
            return batch

    def _settle(self, batch: list[Row], written: bool, stored: int = 0) -> None:
        with self._cond:
            self._in_flight = []
            if not written:  # back to the front, oldest first; the caps apply to them too
                self._buffer.extendleft(reversed(batch))
                self._bytes += sum(len(row.data) for row in batch)
                self._enforce_caps()
            self._cond.notify_all()
        if self.on_batch is not None:
            self.on_batch(stored, self.buffered)

    def _failed(self, exc: BaseException) -> None:
        self.on_error()
        if not self._down_since:
            self._down_since = time.monotonic()
            log.error("per-request records cannot be written to %s now: %s (records wait in a buffer of %d records / %d bytes, "
                      "the oldest dropped past it; counted in llmproxy_records_dropped_total and "
                      "llmproxy_telemetry_errors_total{component=\"records\"}; requests are unaffected)", self.backend.where, exc,
                      self.max_records, self.max_bytes)

    def _pause(self, seconds: float) -> None:
        with self._cond:
            if not self._stopping:
                self._cond.wait(seconds)

    def _run(self) -> None:
        backoff, next_retain = RETRY_S[0], time.monotonic() + self.retain_every_s
        while True:
            batch = self._take()
            if batch is None:
                break
            if self._stopping and time.monotonic() > self._deadline:
                self._settle(batch, written=False)
                break
            if not batch and not self.connected:
                continue  # idle and unreachable: nothing to write, nothing to retain
            if not self.connected:
                try:
                    self.backend.open()
                    self.connected = True
                except Unavailable as exc:
                    self._failed(exc)
                    self._settle(batch, written=False)
                    self._pause(backoff)
                    backoff = min(RETRY_S[1], backoff * 2)
                    continue
            done, stored = not batch, 0  # written, or refused for good: either way it leaves the buffer
            if batch:
                try:
                    stored = self.backend.write(batch)  # (fewer than the batch: ids the store already held)
                    done = True
                    self.written += stored
                except Rejected as exc:
                    self.on_error()
                    self.on_drop("rejected", len(batch))
                    log.error("the records store %s refused %d records (dropped, counted): %s", self.backend.where, len(batch), exc)
                    done = True
                except Unavailable as exc:
                    self.connected = False
                    self._failed(exc)
            if self.connected and time.monotonic() >= next_retain:  # (before the batch is settled: a read after a flush sees it)
                next_retain = time.monotonic() + self.retain_every_s
                try:
                    self.backend.retain()
                except Unavailable as exc:
                    self.connected = False
                    self._failed(exc)
            self._settle(batch, written=done, stored=stored)
            if not self.connected:
                self._pause(backoff)
                backoff = min(RETRY_S[1], backoff * 2)
                continue
            if self._down_since:
                log.warning("the records store %s is reachable again after %.1f s; %d records still waiting", self.backend.where,
                            time.monotonic() - self._down_since, self.buffered)
                self._down_since = 0.0
            backoff = RETRY_S[0]
        with self._cond:
            left = len(self._buffer) + len(self._in_flight)
            self._buffer.clear()
            self._bytes = 0
            self._cond.notify_all()
        if left:
            self.on_drop("shutdown", left)
            log.error("%d records were not written to %s before the shutdown deadline (dropped, counted)", left, self.backend.where)
        self.backend.close()


def is_postgres(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def open_backend(target: str, max_rows: int = -1, max_age_s: float = 7 * 86400.0, password_file: str = "",
                 busy_timeout_s: float = 5.0, bulk: bool = False) -> Backend:
    """The store a `--records-db` value names: a PostgreSQL URL, or an SQLite file path. `max_rows` -1:
    the store's own default. `bulk`: a load that can be run again (`records import`), whose commits
    need not wait for the server's WAL flush."""
    if is_postgres(target):
        from .postgres import PostgresBackend

        return PostgresBackend(target, max_rows, max_age_s, password_file, bulk)
    from .sqlite import SQLiteBackend

    return SQLiteBackend(target, max_rows, max_age_s, busy_timeout_s)

