"""The records' bounded buffer and its writer thread, in front of one backend (the package's docstring says why).

A batch the store refuses is split until the refused record is alone (dropped and counted); anything
unexpected is counted, said once per kind, and the batch kept: the writer never dies. Maintenance
(retention, partitions, compaction, migrations, boots) runs on a thread and connection of its own.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import math
import os
import threading
import time
from typing import Any, Callable

import orjson

from ..wire.chunk import json_object
from . import Backend, Filters, Rejected, Row, Skewed, Unavailable
from .boots import Previous, Serving, Tally, host
from .codec import serialise
from .columns import ended_ns, skew

log = logging.getLogger("llmproxy.records")

BATCH = 500  # rows per transaction at most
FLUSH_S = 0.25  # how long a record may wait for its batch
RETRY_S = (0.2, 5.0)  # the pause after a failure, doubling from the first to the second


class Writer:
    """The bounded buffer and its writer thread, in front of one backend."""

    def __init__(self, backend: Backend, instance: str, max_records: int, max_bytes: int, on_error: Callable[[], None],
                 on_drop: Callable[[str, int], None], on_batch: Callable[[int, int], None] | None = None, batch: int = BATCH,
                 retain: bool = True, on_lost: Callable[[int], None] | None = None, boot: str = "",
                 assigned: Callable[[], int] | None = None, on_nulled: Callable[[str, int], None] | None = None,
                 serving: Callable[[], Serving] | None = None, previous: Previous | None = None,
                 on_maintenance: Callable[[str], None] | None = None) -> None:
        """`on_drop(reason, count)`; `on_batch(written, buffered)` after each batch (the metrics); `batch`: rows per
        transaction at most; without `retain`, no maintenance pass and no boot (an import: it compacts once at its end);
        `on_lost(count)`: records crashed writers lost, as its maintenance accounts them (boots.py); `boot`: its row's
        name (outbox.py: the writer process's), else its own, which its records' ids carry; `assigned`: records handed
        to it (outbox.py: shared memory), else the newest added; `serving`, `previous`: the serving process's figures
        and the writer process this one replaced (boots.py); `on_nulled(field, count)`: figures the store's columns
        could not hold, set to null (columns.check); `on_maintenance(step)`: a failed maintenance pass."""
        self.backend, self.instance, self.on_nulled = backend, instance, on_nulled
        self.max_records, self.max_bytes = max(1, max_records), max(1, max_bytes)
        self.on_error, self.on_drop, self.on_batch, self.on_lost, self.on_maintenance = on_error, on_drop, on_batch, on_lost, on_maintenance
        self.batch = max(1, batch)
        self.retain_every_s = backend.retain_every_s if retain else math.inf
        self.written = 0
        self.dropped = 0  # every record this writer dropped and counted, whatever the reason (its boot's figure)
        self.started_ns = time.time_ns()
        self.connected = False
        self._buffer: collections.deque[Row] = collections.deque()
        self._bytes = 0
        self._in_flight: list[Row] = []
        self._seq = itertools.count(1)
        self._last = 0  # the newest seq added
        self._assigned, self._serving, self._previous, self._seen = assigned, serving, previous, False  # (_seen: a pass wrote its row)
        self._boot = boot or f"{os.getpid()}/{time.time_ns()}"
        self._urgent = False  # a flush is waiting: write now, do not wait for a fuller batch
        self._stopping = False
        self._stop = threading.Event()  # set with _stopping: the maintenance thread's wait ends
        self._reported = 0  # what on_batch said was waiting last
        self._deadline = 0.0
        self._down_since = 0.0  # when the store last became unreachable (0: it is reachable)
        self._said: set[str] = set()  # the kinds of failure logged already
        self._clean = True
        self._cond = threading.Condition()
        backend.tally = self.tally if retain else None
        self._thread = threading.Thread(target=self._run, name="llmproxy-records", daemon=True)
        self._thread.start()
        self._upkeep: threading.Thread | None = None
        if retain:
            self._upkeep = threading.Thread(target=self._maintain, name="llmproxy-records-upkeep", daemon=True)
            self._upkeep.start()

    def tally(self) -> Tally:
        """This writer's figures now, for its boot's row."""
        assigned = self._last if self._assigned is None else self._assigned()
        return Tally(self._boot, self.instance, host(), os.getpid(), self.started_ns, assigned, self.dropped,
                     self._serving() if self._serving is not None else None, self._previous)

    def _drop(self, reason: str, count: int) -> None:
        self.dropped += count
        self.on_drop(reason, count)

    def add(self, record: dict[str, Any]) -> None:
        """The only call on the request side: name the record (its stable `id`), serialise it, append,
        drop the oldest past the caps. One that cannot even be serialised is counted, never lost unseen."""
        seq = next(self._seq)
        record["id"] = rid = f"{self.instance}/{self._boot}/{seq}"
        try:
            row = Row(rid, ended_ns(record), serialise(record), seq)
        except (TypeError, ValueError, KeyError) as exc:
            self._refused(1, exc)
            return
        self._append(row, block=False)

    def put(self, row: Row) -> None:
        """A record named and serialised elsewhere (outbox.py), its number kept; the oldest dropped past the caps."""
        self._append(row, block=False)

    def put_row(self, row: Row) -> None:
        """An exported record (`row`) through the same path, for `records import`: a full buffer makes
        the caller wait instead of dropping."""
        self._append(Row(row.rid, row.ended_ns, row.data, next(self._seq), row.record), block=True)

    @staticmethod
    def row(line: bytes, seq: int = 0, now_ns: int = 0, max_age_s: float = 0.0) -> Row:
        """An exported record's row: it keeps its own `id` (one without is named by its content, so a second import
        skips it too) and its own end time. Read as leniently as the proxy reads a request (chunk.lenient), its figures
        then checked (columns.check). Rejected: not a record; Skewed: its end outside the store's window (`now_ns`,
        `max_age_s`: columns.skew; `now_ns` 0: not checked)."""
        record = json_object(line)
        try:
            if record is None:
                raise TypeError("not a JSON object")
            ended = ended_ns(record)
            rid = record.get("id") or ""
            if not rid:
                record["id"] = rid = "import/" + hashlib.sha256(line.strip()).hexdigest()[:32]
                line = orjson.dumps(record)
            if now_ns and skew(ended, now_ns, max_age_s):
                raise Skewed(f"its end ({ended} ns) is outside the store's window (its retention, or more than an hour ahead)")
            return Row(str(rid), ended, line.strip(), seq, record)
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise Rejected(f"not a record: {exc}") from None

    def _append(self, row: Row, block: bool) -> None:
        with self._cond:
            while block and not self._stopping and (len(self._buffer) >= self.max_records or self._bytes >= self.max_bytes):
                self._cond.wait(1.0)
            self._buffer.append(row)
            self._last = row.seq
            self._bytes += len(row.data)
            if not block:  # (a caller that waits for room is bounded by its wait: its rows are never dropped)
                self._enforce_caps()
            if len(self._buffer) == 1 or len(self._buffer) >= self.batch:  # the writer waits for a first row, or a full batch
                self._cond.notify_all()

    def _enforce_caps(self) -> None:
        dropped = 0
        while self._buffer and (len(self._buffer) > self.max_records or self._bytes > self.max_bytes):
            self._bytes -= len(self._buffer.popleft().data)
            dropped += 1
        if dropped:
            self._drop("buffer_full", dropped)

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

    def close(self, timeout: float = 5.0, clean: bool = True) -> None:
        """Write what is buffered within `timeout` (the server's shutdown), drop and count the rest, stop; `clean`:
        its boot closed (else left running, for the next maintenance pass to count what was lost)."""
        self._clean = clean
        with self._cond:
            self._stopping, self._deadline = True, time.monotonic() + timeout
            self._cond.notify_all()
        self._stop.set()
        self._thread.join(timeout + 1.0)

    def recent(self, limit: int, filters: Filters) -> list[bytes]:
        return self.backend.recent(limit, filters)

    def _take(self) -> list[Row] | None:
        """The next batch (None: stop). Waits for a first row, then up to FLUSH_S for a fuller batch."""
        with self._cond:
            while not self._buffer and not self._stopping:
                reconnect = bool(self.retain_every_s) and not self.connected
                self._cond.wait(1.0 if reconnect else None)  # (connected and idle: asleep until a row or the close)
                if not self._buffer and reconnect:
                    return []  # idle and not connected: a chance to reach the store, for the maintenance thread
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
        waiting = self.buffered
        if self.on_batch is not None and (batch or waiting != self._reported):  # (an idle pass says nothing new: no message)
            self._reported = waiting
            self.on_batch(stored, waiting)

    def _refused(self, count: int, exc: BaseException) -> None:
        """Records the store (or the serialiser) refuses for what they hold: dropped, counted, said once per kind."""
        self.on_error()
        self._drop("rejected", count)
        self._say(exc, f"the records store {self.backend.where} refused %d record%s for what %s held (dropped, counted)" %
                  (count, "" if count == 1 else "s", "it" if count == 1 else "they"))

    def _say(self, exc: BaseException, what: str) -> None:
        """A log line per kind of failure (its type and first line), never one per record."""
        kind = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if kind not in self._said:
            self._said.add(kind)
            log.error("%s: %s (further ones of this kind are counted, not logged)", what, kind)

    def _in_window(self, batch: list[Row]) -> list[Row]:
        """The rows whose end lies where the store keeps records; the others dropped and counted (`clock_skew`): a
        wrong clock somewhere, or an import of another era, must not make partitions for days no one reached."""
        now = time.time_ns()
        kept = [row for row in batch if not skew(row.ended_ns, now, self.backend.max_age_s)]
        if len(kept) < len(batch):
            self._drop("clock_skew", len(batch) - len(kept))
            self._say(ValueError("clock_skew"), "records ending outside the store's window (its retention, or more than an hour ahead of "
                      "this writer's clock) were dropped and counted")
        return kept

    def _store(self, batch: list[Row]) -> int:
        """The batch written (how many were new). A batch the store refuses for what it holds is split until
        each refused record is alone: that one is dropped and counted, its neighbours are written. An
        unexpected failure is taken as such a refusal (a malformed record it could not encode), so the
        writer goes on. Unavailable (down, slow) goes up: the batch waits and is written again."""
        try:
            return self.backend.write(batch)
        except Unavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - Rejected, or anything a record made the backend raise
            if len(batch) == 1:
                self._refused(1, exc)
                return 0
            if not isinstance(exc, Rejected):  # (a refusal is counted with the record it isolates; the unexpected here)
                self.on_error()
                self._say(exc, f"writing {len(batch)} records to {self.backend.where} failed unexpectedly (split and written again)")
            middle = len(batch) // 2
            return self._store(batch[:middle]) + self._store(batch[middle:])

    def _failed(self, exc: BaseException, count: bool = True) -> None:
        if count:  # (an idle writer's attempt to reach the store is not a failure to write)
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
        """The writer thread. It never dies: anything unexpected is counted, said once per kind, the batch
        it held goes back to the buffer, and it goes on; at the end, what is left is counted."""
        while True:
            try:
                self._loop()
                break
            except Exception as exc:  # noqa: BLE001
                self.on_error()
                self._say(exc, f"the records writer for {self.backend.where} failed unexpectedly (it goes on)")
                if self._in_flight:
                    self._settle(self._in_flight, written=False)
                self._pause(RETRY_S[0])
        self._end()

    def _loop(self) -> None:
        backoff = RETRY_S[0]
        while True:
            batch = self._take()
            if batch is None:
                break
            if self._stopping and time.monotonic() > self._deadline:
                self._settle(batch, written=False)
                break
            if not self.connected:  # (idle too: its maintenance, and the boots of writers gone, wait for it)
                try:
                    self.backend.open()
                    self.connected = True
                except Exception as exc:  # noqa: BLE001 - Unavailable, or a bug opening it: either way tried again later
                    self._failed(exc, count=bool(batch))
                    self._settle(batch, written=False)
                    self._pause(backoff)
                    backoff = min(RETRY_S[1], backoff * 2)
                    continue
            done, stored = not batch, 0  # written, or refused for good: either way it leaves the buffer
            if batch:
                try:
                    stored = self._store(self._in_window(batch))  # (fewer than the batch: ids the store already held, or refused ones)
                    done = True
                    self.written += stored
                except Unavailable as exc:
                    self.connected = False
                    self._failed(exc)
                for field, count in self.backend.columns.take_nulled().items():  # (figures no column holds: nulled, the record kept)
                    if self.on_nulled is not None:
                        self.on_nulled(field, count)
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

    def _maintain(self) -> None:
        """The maintenance thread: every `retain_every_s`, once the store is reachable, the backend's pass on its
        own connection (retention, compaction, migrations, boots), off the write path. It never dies either."""
        while not self._stopping:
            # (its own event, not the writer's condition: every first row's notify would wake it for nothing)
            if self._stop.wait(self.retain_every_s) or self._stopping or not self.connected:
                continue
            try:
                lost, unreadable = self.backend.maintain()
                self._previous, self._seen = None, True  # (its row written, the one before settled)
                if lost and self.on_lost is not None:
                    self.on_lost(lost)
                if lost:
                    log.error("%d records were lost by writers that stopped without writing them (a kill -9, a crash): counted in "
                              "llmproxy_records_lost_total, and in the store's llmproxy_boots", lost)
                if unreadable:
                    self._refused(unreadable, ValueError("rows of an older schema that are no record"))
            except Exception as exc:  # noqa: BLE001 - unreachable, a bug, a row it cannot read: it goes on, the writes too
                step = self.backend.step
                if self.on_maintenance is not None:
                    self.on_maintenance(step)
                if not isinstance(exc, Unavailable):
                    self.on_error()
                self._say(exc, f"the records store's maintenance ({step}) on {self.backend.where} failed (tried again at the next pass; "
                               "counted in llmproxy_records_maintenance_errors_total)")

    def _end(self) -> None:
        if self._upkeep is not None:
            self._upkeep.join(10.0)
        recorded = self.connected and self.backend.closed(self._clean)  # (not clean: its last figures, left running for a pass)
        with self._cond:
            left = len(self._buffer) + len(self._in_flight)
            self._buffer.clear()
            self._bytes = 0
            self._cond.notify_all()
        open_row = self.backend.tally is not None and (self.written > 0 or self._seen) and not (recorded and self._clean)
        if left:  # (its row left open in the store: the next pass there counts them lost, once; else they are counted here)
            if not open_row:
                self._drop("shutdown", left)
            log.error("%d records were not written to %s before the shutdown deadline (%s)", left, self.backend.where,
                      "counted lost by the next pass on the store: this writer's row is left open" if open_row else "dropped, counted")
        self.backend.close()
