"""Records moving between stores: `records export` writes a store's records as JSON lines (each with
its stable `id`, as /llmproxy/requests shows them); `records import` reads them into another store
through the proxy's own write path: the writer's buffer (bounded: the reader waits when it is full),
the store's batch transaction with the rollup, each record in the hour of its own end time, and the
ids the store already holds skipped. This is how a user who outgrows the embedded SQLite moves to the
fleet's PostgreSQL with the history, and how a store is seeded for a test or a bench.

An import reads with `WORKERS` processes at once, each a writer of its own (parsing a record and
making its columns is as much work as the server's inserting it: a process each keeps both cores
busy), taking chunks of lines from a bounded queue, and compacts the blocks and hours they have all
gone past as it goes, on a connection of its own (one reached again is marked dirty and compacted
once more at the end), so a day of history is ready to read when it returns.
"""
from __future__ import annotations

import collections
import gc
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterable

from . import Backend, Rejected, Skewed, Writer, is_postgres

WORKERS = 2
BATCH = 20_000  # rows per transaction (the proxy's own batches: 500 at most; a file in random order touches a rollup row per record or so: 8% faster than 5,000)
CHUNK = 4 * 1024 * 1024  # bytes of lines handed to a worker at a time (whole lines: split by the worker)
BUFFER = 20_000  # records waiting in a worker's writer (a batch taken leaves room for the next: about 34 MB of JSON, under the writer's 64 MB)
LAG = 2 * BUFFER  # records behind a worker's reading a block is taken as written (what may still be buffered)
DOWN_S = 30.0  # an import gives up after the store has been unreachable this long
ERRORS = 10  # bad lines reported by number (the rest counted)


@dataclass
class Imported:
    lines: int = 0
    stored: int = 0
    rejected: int = 0  # lines that are no record, and (of them) `skewed`: records outside the store's window
    skewed: int = 0
    dropped: int = 0
    nulled: dict[str, int] = field(default_factory=dict)  # figures no column holds, set to null (the records kept)
    compacted: int = 0  # blocks and hours
    seconds: float = 0.0
    final_s: float = 0.0  # of which compacting what was left at the end

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
        self.store, self.before_ns, self.done = store, 0, 0
        self.error: BaseException | None = None
        self._wake, self._done = threading.Event(), False

    def advance(self, before_ns: int) -> None:
        if before_ns > self.before_ns:
            self.before_ns = before_ns
            self._wake.set()

    def run(self) -> None:
        try:
            self.store.open()
            while not self._done:
                self._wake.wait(1.0)
                self._wake.clear()
                self.done += self.store.compact(self.before_ns)
        except BaseException as exc:  # noqa: BLE001 - reported by `finish`; the final pass compacts what is left
            self.error = exc
        finally:
            self.store.close()

    def finish(self) -> None:
        self._done = True
        self._wake.set()
        self.join()


def _work(open_store: Callable[[], Backend], chunks: Any, progress: Any, index: int, results: Any) -> None:
    """A worker process: chunks of lines (each with the number of its first line) through a writer of its own, until
    a None. A line that is no record, or one outside the store's window, is counted and reported with its number."""
    gc.disable()  # (records hold no cycles; a collector walking the buffer's dicts would cost a third of the time)
    dropped: collections.Counter[str] = collections.Counter()
    nulled: collections.Counter[str] = collections.Counter()
    store = open_store()
    writer = Writer(store, "import", BUFFER, 64 * 1024 * 1024, lambda: None, lambda reason, n: dropped.update({reason: n}),
                    batch=BATCH, retain=False, on_nulled=lambda field, n: nulled.update({field: n}))
    # The least end time among the last LAG records read (a sliding minimum: (position, end time), increasing), so that
    # a file in time order advances the compaction behind it and one in random order does not (any block may still get
    # records: compacted early, it would be compacted again).
    lowest: collections.deque[tuple[int, int]] = collections.deque()
    lines, rejected, skewed, failure = 0, 0, 0, ""
    errors: list[str] = []
    while (item := chunks.get()) is not None:
        if failure:
            continue  # (drained, so that the reader never waits on a full queue)
        first, chunk = item
        now = time.time_ns()
        for number, line in enumerate(chunk.split(b"\n"), start=first):
            if not line.strip():
                continue
            lines += 1
            try:
                row = Writer.row(line, now_ns=now, max_age_s=store.max_age_s)
            except Rejected as exc:
                if isinstance(exc, Skewed):
                    skewed += 1
                else:
                    rejected += 1
                if len(errors) < ERRORS:  # (what is reported: a file of junk lines must not grow a list of its own)
                    errors.append(f"line {number}: {str(exc)[:300]}")
                continue
            writer.put_row(row)
            while lowest and lowest[-1][1] >= row.ended_ns:
                lowest.pop()
            lowest.append((lines, row.ended_ns))
            if lowest[0][0] <= lines - LAG:
                lowest.popleft()
        if lines >= LAG:
            progress[index] = lowest[0][1]
        if writer.down_s > DOWN_S:
            failure = f"the records store {writer.backend.where} has been unreachable for {DOWN_S:.0f} s"
    writer.close(timeout=3600)
    results.put((lines, writer.written, rejected + skewed, skewed, sum(dropped.values()) - dropped["clock_skew"], dict(nulled), errors, failure))


def compact_all(open_store: Callable[[], Backend]) -> int:
    """Every block and hour due, now: on PostgreSQL on WORKERS connections at once (each takes the units the
    others are not at), on SQLite on one (the file has one writer at a time). How many."""
    stores = [open_store()]
    if is_postgres(stores[0].where):
        stores += [open_store() for _ in range(WORKERS - 1)]
    done = [0] * len(stores)

    def run(index: int) -> None:
        store = stores[index]
        store.open()
        try:
            done[index] = store.compact()
        finally:
            store.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(stores))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    return sum(done)


def _put(chunks: Any, item: Any, workers: list[Any]) -> None:
    """A chunk to the workers' queue: waiting while it is full, but never on workers that are all gone."""
    while True:
        try:
            chunks.put(item, timeout=1.0)
            return
        except queue.Full:
            if not any(worker.is_alive() for worker in workers):
                raise ValueError("every import worker has stopped") from None


def _reports(results: Any, workers: list[Any]) -> list[tuple[Any, ...]]:
    """Each worker's report; a worker that died without one (killed, out of memory) is a failure said, never a wait."""
    reports: list[tuple[Any, ...]] = []
    while len(reports) < len(workers):
        try:
            reports.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [worker for worker in workers if not worker.is_alive()]
            if len(dead) > len(reports) and results.empty():  # (more gone than reported: one went without its report)
                failed = f"an import worker stopped without its report (exit code {dead[0].exitcode})"
                reports += [(0, 0, 0, 0, 0, {}, [], failed)] * (len(workers) - len(reports))
    return reports


def run_import(source: BinaryIO, open_store: Callable[[], Backend], warn: Callable[[str], None]) -> Imported:
    """JSON lines from `source` into the store `open_store` opens (once per connection). The reader
    only cuts the stream into chunks of whole lines; the workers parse them."""
    result = Imported()
    began = time.monotonic()
    context = multiprocessing.get_context("fork")
    chunks, results = context.Queue(maxsize=2 * WORKERS), context.Queue()
    progress = context.Array("q", [0] * WORKERS)
    workers = [context.Process(target=_work, args=(open_store, chunks, progress, i, results), daemon=True) for i in range(WORKERS)]
    for worker in workers:
        worker.start()
    compactor = _Compactor(open_store())
    compactor.start()
    rest, number = b"", 1  # (the number of the first line not handed out yet)
    try:
        while block := source.read(CHUNK):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut:
                _put(chunks, (number, block[:cut]), workers)
                number += block.count(b"\n", 0, cut)
            rest = block[cut:]
            reached = [int(progress[i]) for i in range(WORKERS)]
            if all(reached):
                compactor.advance(min(reached))
        if rest:
            _put(chunks, (number, rest), workers)
    finally:
        for _ in workers:
            _put(chunks, None, workers)
        reports = _reports(results, workers)
        for worker in workers:
            worker.join(5.0)
        compactor.finish()
    failures = [report[-1] for report in reports if report[-1]]
    if failures:
        raise ValueError(failures[0])
    errors = []
    for lines, stored, rejected, skewed, dropped, nulled, said, _ in reports:
        result.lines += lines
        result.stored += stored
        result.rejected += rejected
        result.skewed += skewed
        result.dropped += dropped
        for name, count in nulled.items():
            result.nulled[name] = result.nulled.get(name, 0) + count
        errors += said
    for error in sorted(errors, key=lambda e: int(e.split(":", 1)[0].split()[1]))[:ERRORS]:
        warn(error)
    if compactor.error is not None:
        warn(f"compacting while importing: {compactor.error} (compacted at the end instead)")
    final = time.monotonic()
    result.compacted = compactor.done + compact_all(open_store)  # what is left: the last blocks and hours (a file in random order: all)
    result.seconds, result.final_s = time.monotonic() - began, time.monotonic() - final
    return result
