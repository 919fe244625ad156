"""The records store of a fleet: PostgreSQL (`--records-db postgresql://USER@HOST:PORT/DB`). Every
replica writes to one store; every reader (`explain --db postgresql://…`, `/llmproxy/requests` and
`/ui` on any replica) sees all of them, each record tagged with its `instance`.

- Driver: psycopg 3, on the writer thread (libpq releases the GIL while it waits on the network).
- Tables, each partitioned by day (declarative range partitions, `llmproxy_records_YYYYMMDD` …):
  `llmproxy_records` (the records: typed columns, cells, the JSON), and the hourly aggregates
  `llmproxy_rollup` and `llmproxy_hist` (aggregate.py), which `explain`, the SLO summaries and `/ui`'s
  summaries read instead of the records.
- Writes: one transaction per batch: COPY into the session's staging table, then one statement that
  inserts the records (`ON CONFLICT (ended_ns, key) DO NOTHING`: a batch sent again after a lost
  commit reply, or an import's line already held, is stored once: found by its key in the unique
  index, never by reading the batch's time range, so an import in any order costs what one in order
  does), adds exactly the inserted ones to the aggregates, marks dirty what a compaction already read
  of them (sql.dirty) and moves the writer's boot on (boots.py). `data` is the record compressed (codec.py).
- Partitions (partitions.py): made ahead, dropped whole past `--records-max-age` or `--records-max-rows`; one replica
  at a time (the retention advisory lock), every `RETAIN_EVERY_S`, in its maintenance thread, on a connection of its
  own. Days, compaction and crash accounting go by the store's clock (`now()`).
- Every connection has TCP keepalives, every call a client-side deadline (deadline.py): a silent store costs seconds.
- Schema: versions and online migrations in migration.py. Schema 1's unpartitioned `llmproxy_requests` is left as it
  is (a rolling upgrade's old replicas write to it); the maintenance pass moves its records in (oldest first,
  `MOVE_CHUNK` at a time, the same write path, within `BUDGET_S`); a row it cannot read is dropped and counted.
- The password: the URL, `--records-db-password-file` (re-read at each connect) or libpq's `PGPASSWORD`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import math
import threading
import time
from typing import Any, Callable, Iterator

import orjson
import psycopg

from . import Filters, Rejected, Row, Unavailable
from . import boots
from . import codec
from . import columns as C
from . import sql as A
from .aggregate import Fold
from .deadline import Watchdog, connect, redact, scrubbed
from .migration import LEVEL, TYPES, Newer, finish, prepare
from .partitions import TABLE, Partitions

STORE_VERSION = LEVEL
LEGACY = "llmproxy_requests"  # schema 1's table
RETAIN_LOCK = 0x6C6D7002  # advisory locks ("lm" p n; 1, 5: migration.py; 3: partitions.py)
COMPACT_LOCK = 0x6C6D7004  # one per block or hour: (this, its start / its span, + 2^30 for an hour)
RETAIN_EVERY_S = 5.0
WRITE_S, READ_S, OPEN_S, MAINTAIN_S = 10.0, 3.0, 300.0, 300.0  # client-side deadlines (deadline.py): a batch, a read, opening, a pass
MOVE_CHUNK = 5000
ROWS_AT_ONCE = 20_000  # rows a reader makes into tuples at once (_rows)
BUDGET_S = 2.0  # what one maintenance pass may spend compacting hours and moving schema 1's records in
NAMES = (*C.COLUMNS, "data")
COPY_TYPES = [TYPES.get(name, "bytea") for name in NAMES]
STAGE = "llmproxy_stage"  # the session's: each batch COPYed in, inserted from, gone at commit
KEY, ENDED = C.COLUMNS.index("key"), C.COLUMNS.index("ended_ns")
WORK_MEM = "SET LOCAL work_mem = '64MB'"  # the histograms' hash tables in memory (the server's 4 MB default spills them: 2x slower)
NOW = "SELECT (extract(epoch from clock_timestamp()) * 1000000000)::bigint"  # the store's clock, ns
# One statement per batch: the staged rows the store does not hold yet inserted (the unique index finds the others),
# added to the rollup, and the units a compaction read already marked dirty (sql.dirty, from the inserted rows).
INSERT = A.POSTGRES.sql(
    f"WITH new AS (INSERT INTO {TABLE} ({', '.join(NAMES)}) SELECT {', '.join(NAMES)} FROM {STAGE} ON CONFLICT (ended_ns, key) DO NOTHING "
    f"RETURNING *), up AS ({A.rollup(A.POSTGRES, 'new')}), "
    f"late AS (INSERT INTO llmproxy_dirty (span, start) SELECT DISTINCT c.span, c.start FROM llmproxy_compacted c JOIN new r "
    f"ON c.start = r.ended_ns - r.ended_ns % c.span AND c.span IN ({A.BLOCK_NS}, {C.HOUR_NS}) ON CONFLICT DO NOTHING) "
    f"SELECT count(*) FROM new")


def _lock_key(span: int, start: int) -> int:
    """A block's or an hour's advisory lock (its index: 3 million blocks since the epoch, an int4)."""
    return start // span + (1 << 30 if span == C.HOUR_NS else 0)


def _stage(conn: psycopg.Connection[Any]) -> None:
    """The session's staging table (a batch is COPYed in, inserted from, and gone at its commit)."""
    conn.execute(f"CREATE TEMPORARY TABLE IF NOT EXISTS {STAGE} (LIKE {TABLE} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS")


def now_ns(conn: psycopg.Connection[Any]) -> int:
    return int(conn.execute(NOW).fetchone()[0])  # type: ignore[index]


class PostgresBackend:
    retain_every_s = RETAIN_EVERY_S

    def __init__(self, url: str, max_rows: int = -1, max_age_s: float = 7 * 86400.0, password_file: str = "", bulk: bool = False,
                 max_models: int = 100, known_models: tuple[str, ...] = (), read_s: float = READ_S) -> None:
        self.url, self.password_file = url, password_file
        self.read_s = read_s  # a read's deadline and statement_timeout: the pages' seconds, or a command's minutes
        self.columns = C.Columns(max_models, known_models)  # (the rollup's model names; the figures checked, counted)
        # An import's sessions commit without waiting for the WAL flush (synchronous_commit off, theirs
        # only): a server crash loses their last commits, records and aggregates together (one
        # transaction), and the import run again stores them (it skips the ids already held).
        self.session = "-c statement_timeout=30000" + (" -c synchronous_commit=off" if bulk else "")
        self.where = redact(url)
        self.max_rows = max(0, max_rows)  # (the default, -1: no row cap; age alone bounds the store)
        self.max_age_s = max_age_s
        self.conn: psycopg.Connection[Any] | None = None  # the writer's
        self.partitions = Partitions()
        self.moved_bad = 0  # schema 1's rows that were no record (dropped while moving them in: the writer counts them)
        self.maint: psycopg.Connection[Any] | None = None  # the maintenance thread's
        self.maint_partitions = Partitions()
        self.tally: Callable[[], boots.Tally] | None = None  # the writer's own figures (records.Writer sets it; an import has none)
        self.step = "connect"  # the maintenance step under way (a failure is counted as it)
        self._readers: list[psycopg.Connection[Any] | None] = [None, None]
        self._reader_locks = (threading.Lock(), threading.Lock())
        self.watchdog = Watchdog()  # every call's client-side deadline (deadline.py)

    def _connect(self, **options: Any) -> psycopg.Connection[Any]:
        try:
            return connect(self.url, self.password_file, **options)
        except psycopg.Error as exc:
            raise Unavailable(scrubbed(exc, self.url)) from None
        except OSError as exc:  # the password file
            raise Unavailable(f"{self.password_file}: {exc.strerror or exc}") from None

    def open(self) -> None:
        """The writer's connection: the store made, or an older one's columns added (migration.py); its
        staging table; its days' partitions."""
        conn = self._connect(options=self.session)
        try:
            with self.watchdog.deadline(conn, OPEN_S):
                prepare(conn)
                _stage(conn)
                self.partitions = Partitions()
                self.partitions.ahead(conn, now_ns(conn))
        except Newer as exc:
            conn.close()
            raise Unavailable(str(exc)) from None
        except psycopg.Error as exc:
            conn.close()
            raise Unavailable(scrubbed(exc, self.url)) from None
        self.conn = conn

    def write(self, rows: list[Row]) -> int:
        conn = self.conn
        assert conn is not None
        try:
            values = [self.columns.row(r.rid, r.parsed(), r.data) for r in rows]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise Rejected(f"not a record: {exc}") from None
        try:
            with self.watchdog.deadline(conn, WRITE_S):
                self.partitions.ensure(conn, {row.ended_ns // C.DAY_NS for row in rows})
                with conn.transaction():
                    stored = self._insert(conn, values)
                    if self.tally is not None:
                        conn.execute(*boots.upsert(A.POSTGRES, self.tally(), stored, now_ns(conn)))
                    return stored
        except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as exc:  # what these rows hold
            raise Rejected(scrubbed(exc, self.url)) from None
        except psycopg.Error as exc:  # down, restarting, slow, the table gone: reconnect (and migrate) and retry
            self.close()
            raise Unavailable(scrubbed(exc, self.url)) from None

    @staticmethod
    def _insert(conn: psycopg.Connection[Any], values: list[tuple[Any, ...]]) -> int:
        """Inside a transaction: the rows COPYed into the stage, then the one statement (INSERT) that stores those
        the store does not hold, adds them to the rollup and marks dirty what a compaction read. How many were new."""
        keys = [_lock_key(span, start) for span, start in A.units(v[ENDED] for v in values)]
        conn.execute("SELECT pg_advisory_xact_lock_shared(%s, k) FROM unnest(%s::int[]) AS k", (COMPACT_LOCK, keys))  # (a compaction waits)
        with conn.cursor().copy(f"COPY {STAGE} ({', '.join(NAMES)}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(COPY_TYPES)
            for value in values:
                copy.write_row(value)
        return int(conn.execute(INSERT).fetchone()[0])  # type: ignore[index]

    def maintain(self) -> tuple[int, int]:
        """The maintenance thread's pass, on its own connection, one replica at a time: partitions ahead, whole
        days dropped past the age and row limits, the hours due compacted and schema 1's records moved in
        (within BUDGET_S), an older level's indexes built (migration.py); this writer's boot seen, the boots of
        writers gone accounted (boots.py). (What they lost, newly counted; schema 1's rows that were no record.)"""
        try:
            conn = self.maint
            if conn is None or conn.closed:
                self.step = "connect"
                conn = self.maint = self._connect()
                _stage(conn)  # (schema 1's records move in through the same statement)
                self.maint_partitions = Partitions()
            with self.watchdog.deadline(conn, MAINTAIN_S):
                return self._maintain(conn)
        except psycopg.Error as exc:
            if self.maint is not None:
                self.maint.close()
            raise Unavailable(scrubbed(exc, self.url)) from None

    def _maintain(self, conn: psycopg.Connection[Any]) -> tuple[int, int]:
        self.step = "boots"
        now = now_ns(conn)
        tally = self.tally() if self.tally is not None else None
        lost = (boots.seen(conn, A.POSTGRES, tally, now) if tally else 0) + boots.account(conn, A.POSTGRES, now, tally.boot if tally else "")
        if not conn.execute("SELECT pg_try_advisory_lock(%s)", (RETAIN_LOCK,)).fetchone()[0]:  # type: ignore[index]
            return lost, 0  # another replica is at it
        try:
            partitions, self.step = self.maint_partitions, "partitions"
            partitions.ahead(conn, now)
            self.step = "retention"
            expired = partitions.expired(conn, self.max_age_s, self.max_rows, now)
            began, self.step = time.monotonic(), "compaction"
            self._compact(conn, budget_s=BUDGET_S)
            self.step = "migration"
            while time.monotonic() - began < BUDGET_S and self._move(conn):
                pass
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (RETAIN_LOCK,))
        self.step = "retention"  # (the waits, a detach's and an index build's, outside the lock: the others compact meanwhile)
        partitions.drop_all(conn, expired)
        self.step = "migration"
        finish(conn)
        bad, self.moved_bad = self.moved_bad, 0
        return lost, bad

    def closed(self, clean: bool = True) -> bool:
        """The writer stops: its boot closed with its last figures (not `clean`: left running, for a pass to account).
        False where its row could not be written: what it could not write is then the next pass's to count, as lost."""
        if self.conn is None or self.tally is None:
            return self.tally is None
        try:
            with self.watchdog.deadline(self.conn, READ_S), self.conn.transaction():
                boots.close(self.conn, A.POSTGRES, self.tally(), now_ns(self.conn), clean)
            return True
        except psycopg.Error:
            return False

    def compact(self, before_ns: int = A.INF_NS) -> int:
        """Every block and hour due (ending before `before_ns`), now: how many (an import's)."""
        conn = self.conn
        assert conn is not None
        return self._compact(conn, before_ns)

    @staticmethod
    def _compact(conn: psycopg.Connection[Any], before_ns: int = A.INF_NS, budget_s: float = math.inf) -> int:
        @contextlib.contextmanager
        def transaction(span: int, start: int) -> Iterator[bool]:
            with conn.transaction():  # (its writers hold the lock's shared side: it waits for them; another compaction: not)
                if not conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", (COMPACT_LOCK, _lock_key(span, start))).fetchone()[0]:  # type: ignore[index]
                    if conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s AND mode = "
                                    "'ExclusiveLock' AND granted", (COMPACT_LOCK, _lock_key(span, start))).fetchone()[0]:  # type: ignore[index]
                        yield False
                        return
                    conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (COMPACT_LOCK, _lock_key(span, start)))
                conn.execute(WORK_MEM)
                yield True

        return A.compact(conn, A.POSTGRES, transaction, lambda: now_ns(conn), before_ns, budget_s)

    def _move(self, conn: psycopg.Connection[Any]) -> bool:
        """One chunk of schema 1's records into this schema, and out of its table, in one transaction; a row
        that is no record is dropped with them (counted in `moved_bad`)."""
        if conn.execute("SELECT to_regclass(%s)", (LEGACY,)).fetchone()[0] is None:  # type: ignore[index]
            return False
        with conn.transaction():
            rows = conn.execute(f"SELECT id, rid, data::text FROM {LEGACY} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED", (MOVE_CHUNK,)).fetchall()
            if not rows:
                return False
            values = []
            for _, rid, data in rows:
                try:
                    record = orjson.loads(data)
                    record["id"] = rid
                    values.append(self.columns.row(rid, record))
                except (ValueError, TypeError, KeyError, AttributeError):
                    self.moved_bad += 1
            if values:
                self.maint_partitions.ensure(conn, {value[ENDED] // C.DAY_NS for value in values})
                self._insert(conn, values)
            conn.execute(f"DELETE FROM {LEGACY} WHERE id = ANY(%s)", ([row[0] for row in rows],))
        return True

    def close(self) -> None:
        for attribute in ("conn", "maint"):
            conn = getattr(self, attribute)
            if conn is not None:
                try:
                    conn.close()
                except psycopg.Error:
                    pass  # (already broken: closing it is all that was left)
                setattr(self, attribute, None)

    # Readers: two connections, kept (a connection costs a password exchange: /ui asks every 2 s), one
    # reader at a time on each (a window's read uses both at once); dropped when one fails, made again
    # by the next read.

    @contextlib.contextmanager
    def _reading(self, second: bool = False) -> Iterator[psycopg.Connection[Any] | None]:
        """The readers' connection (or their second); None while no replica of this version has written."""
        index = int(second)
        lock = self._reader_locks[index]
        if not lock.acquire(timeout=self.read_s):  # (a read already waits on a store gone silent: this one is not added to it)
            raise Unavailable("the records store did not answer a read in time")
        try:
            conn = self._readers[index]
            if conn is None or conn.closed:
                conn = self._readers[index] = self._connect(options=f"-c statement_timeout={int(self.read_s * 1000)}")
            try:
                with self.watchdog.deadline(conn, self.read_s):
                    yield conn if conn.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is not None else None  # type: ignore[index]
            except psycopg.Error as exc:  # (cut at its deadline, the store gone): a reader's caller sees Unavailable, no driver error
                conn.close()
                raise Unavailable(scrubbed(exc, self.url)) from None
        finally:
            lock.release()

    def _read(self, sql: str, args: list[Any] | tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._reading() as conn:
            return conn.execute(sql, args).fetchall() if conn is not None else []

    def recent(self, limit: int, filters: Filters) -> list[bytes]:
        """The fleet's newest `limit` records, oldest first (every replica's; `instance` selects one)."""
        where, args = _where(filters)
        rows = self._read(f"SELECT data FROM {TABLE}{where} ORDER BY ended_ns DESC LIMIT %s", (*args, max(0, limit)))
        return [codec.unpack(row[0]) for row in reversed(rows)]

    def aggregate(self, into: Fold, window: A.Window, cells: bool = True) -> None:
        with self._reading() as conn:
            if conn is None:
                return
            if not cells:
                ((sums, sargs),) = A.queries(A.POSTGRES, into.by, window)
                into.sums(_rows(conn.execute(sums, sargs)))
                return
            with conn.transaction():  # (one snapshot for the plan and both reads)
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                conn.execute(WORK_MEM)
                self._read_window(conn, into, window)

    def _read_window(self, conn: psycopg.Connection[Any], into: Fold, window: A.Window) -> None:
        """The sums here; the parts of the histograms (the compacted hours and blocks, each in two, then the records'
        edges, each cut in two) on this connection and a second one at once, each taking the next part when it is
        done with one: the server counts on both cores, and both end together. Each folds its rows as its cursor
        yields them; the second's histograms are merged after."""
        clean = conn.execute(A.POSTGRES.sql(A.CLEAN), (window.first_block, A.kept_from(now_ns(conn), by_day=True))).fetchall()
        (sums, sargs), *parts = A.queries(A.POSTGRES, into.by, window, A.halved(A.plan(window, clean), time.time_ns()), split=2)
        todo = collections.deque(parts)

        def drain(c: psycopg.Connection[Any], fold: Fold) -> Fold:
            while todo:
                try:
                    text, args = todo.popleft()
                except IndexError:  # (the other took the last)
                    break
                fold.cells(_rows(c.execute(text, args)))
            return fold

        with self._reading(second=True) as other:
            def run() -> Fold:
                assert other is not None
                with other.transaction():
                    other.execute(WORK_MEM)
                    return drain(other, Fold(into.by))

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                theirs = pool.submit(run)
                into.sums(_rows(conn.execute(sums, sargs)))
                drain(conn, into)
                into.merge_cells(theirs.result())

    def samples(self, wanted: list[tuple[str, str, str, int]], window: A.Window) -> list[list[tuple[int, float, float]]]:
        """Half of them on each reader connection, at once."""
        def some(second: bool, part: list[tuple[str, str, str, int]]) -> list[list[tuple[int, float, float]]]:
            with self._reading(second) as conn:
                return [A.sampled(conn, A.POSTGRES, *each, window) if conn is not None else [] for each in part]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            theirs = pool.submit(some, True, wanted[1::2])
            mine = some(False, wanted[0::2])
            out: list[list[tuple[int, float, float]]] = [[] for _ in wanted]
            out[0::2], out[1::2] = mine, theirs.result()
            return out

    def export(self, start_ns: int) -> Iterator[bytes]:
        with self._connect() as conn:
            if conn.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is None:  # type: ignore[index]
                return
            with conn.transaction(), conn.cursor(name="llmproxy_export") as cursor:
                cursor.itersize = 5000
                cursor.execute(f"SELECT data FROM {TABLE} WHERE ended_ns >= %s ORDER BY ended_ns", (start_ns,))
                for (data,) in cursor:
                    yield codec.unpack(data)

    def pending(self) -> int:
        with self._connect() as conn:
            if conn.execute("SELECT to_regclass(%s)", (LEGACY,)).fetchone()[0] is None:  # type: ignore[index]
                return 0
            return int(conn.execute(f"SELECT count(*) FROM {LEGACY}").fetchone()[0])  # type: ignore[index]


def _rows(cursor: psycopg.Cursor[Any]) -> Iterator[tuple[Any, ...]]:
    """A result's rows a batch at a time: made into tuples in bulk, as fetchall does (a row at a time: 20% slower), never all at once."""
    while rows := cursor.fetchmany(ROWS_AT_ONCE):
        yield from rows


def _where(filters: Filters) -> tuple[str, list[Any]]:
    return filters.where("%s")
