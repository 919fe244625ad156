"""Records moving between stores: `records export` writes a store's records as JSON lines (each with
its stable `id`, as /llmproxy/requests shows them); `records import` reads them into another store
through the proxy's own write path: the writer's buffer (bounded: the reader waits when it is full),
the store's batch transaction with the rollup, each record in the hour of its own end time, and the
ids the store already holds skipped. This is how a user who outgrows the embedded SQLite moves to the
fleet's PostgreSQL with the history, and how a store is seeded for a test or a bench.

An import writes from `WRITERS` connections at once (batches alternate; the server's work is most of
the cost, and a second connection puts it on a second core) and compacts the hours it has gone past
as it goes, on a connection of its own (an hour it reaches again is marked dirty and compacted once
more at the end), so a day of history is ready to read when it returns.
"""
from __future__ import annotations

import collections
import gc
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable

from . import Backend, Rejected, Writer
from .columns import HOUR_NS

WRITERS = 2
BATCH = 5000  # rows per transaction: an import's batches are large (the proxy's own: 500 at most)
BUFFER = 20_000  # records waiting per writer
LAG = 2 * WRITERS * BUFFER  # lines behind the reader an hour is taken as complete (what may still be buffered)
DOWN_S = 30.0  # an import gives up after the store has been unreachable this long


@dataclass
class Imported:
    lines: int = 0
    stored: int = 0
    rejected: int = 0
    dropped: int = 0
    hours: int = 0  # compacted
    seconds: float = 0.0

    @property
    def skipped(self) -> int:
        """Records the store already held."""
        return self.lines - self.rejected - self.stored - self.dropped


def export(stores: Iterable[Backend], start_ns: int, out: BinaryIO) -> int:
    """Every record of the stores since `start_ns`, oldest first per store, one JSON line each."""
    count = 0
    for store in stores:
        for data in store.export(start_ns):
            out.write(data + b"\n")
            count += 1
    out.flush()
    return count


class _Compactor(threading.Thread):
    """Compacts, on its own connection, the hours the import has gone past."""

    def __init__(self, store: Backend) -> None:
        super().__init__(name="llmproxy-import-compact", daemon=True)
        self.store, self.before_hour, self.hours = store, 0, 0
        self.error: BaseException | None = None
        self._wake, self._done = threading.Event(), False

    def advance(self, hour: int) -> None:
        if hour > self.before_hour:
            self.before_hour = hour
            self._wake.set()

    def run(self) -> None:
        try:
            self.store.open()
            while not self._done:
                self._wake.wait(1.0)
                self._wake.clear()
                self.hours += self.store.compact(before_hour=self.before_hour)
        except BaseException as exc:  # noqa: BLE001 - reported by `finish`; the final pass compacts what is left
            self.error = exc
        finally:
            self.store.close()

    def finish(self) -> None:
        self._done = True
        self._wake.set()
        self.join()


def run_import(lines: Iterable[bytes], open_store: Callable[[], Backend], warn: Callable[[str], None]) -> Imported:
    """JSON lines into the store `open_store` opens (once per connection)."""
    result = Imported()
    began = time.monotonic()
    dropped: collections.Counter[str] = collections.Counter()
    gc.disable()  # (records hold no cycles; a collector walking the buffers' dicts would cost a third of the time)
    writers = [Writer(open_store(), "import", BUFFER, 64 * 1024 * 1024, lambda: None, lambda reason, n: dropped.update({reason: n}),
                      batch=BATCH, retain=False) for _ in range(WRITERS)]
    compactor = _Compactor(open_store())
    compactor.start()
    recent: collections.deque[int] = collections.deque(maxlen=LAG)
    try:
        for line in lines:
            if not line.strip():
                continue
            result.lines += 1
            try:
                row = Writer.row(line)
            except Rejected as exc:
                result.rejected += 1
                if result.rejected <= 3:
                    warn(f"line {result.lines}: {exc}")
                continue
            writers[(result.lines // BATCH) % WRITERS].put_row(row)
            recent.append(row.ended_ns)
            if result.lines % BATCH == 0:
                if len(recent) == LAG:
                    compactor.advance(recent[0] // HOUR_NS)
                if any(writer.down_s > DOWN_S for writer in writers):
                    raise ValueError(f"the records store {writers[0].backend.where} has been unreachable for {DOWN_S:.0f} s")
    finally:
        for writer in writers:
            writer.close(timeout=3600)
        compactor.finish()
        gc.enable()
    if compactor.error is not None:
        warn(f"compacting while importing: {compactor.error} (compacted at the end instead)")
    store = open_store()
    store.open()  # what is left: the last hours, and any an out-of-order line reached again
    try:
        result.hours = compactor.hours + store.compact()
    finally:
        store.close()
    result.stored = sum(writer.written for writer in writers)
    result.dropped = sum(dropped.values())
    result.seconds = time.monotonic() - began
    return result
