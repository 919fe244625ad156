"""The records store of a fleet: PostgreSQL (`--records-db postgresql://USER@HOST:PORT/DB`). Every
replica writes to one store; every reader (`explain --db postgresql://…`, `/llmproxy/requests` and
`/ui` on any replica) sees all of them, each record tagged with its `instance`.

- Driver: psycopg 3, on the writer thread (libpq releases the GIL while it waits on the network).
- Tables, each partitioned by day (declarative range partitions, `llmproxy_records_YYYYMMDD` …):
  `llmproxy_records` (the records: typed columns, cells, the JSON), and the hourly aggregates
  `llmproxy_rollup` and `llmproxy_hist` (aggregate.py), which `explain`, the SLO summaries and `/ui`'s
  summaries read instead of the records.
- Writes: one transaction per batch: COPY into a temporary staging table, then one statement that
  inserts the records (`ON CONFLICT (ended_ns, key) DO NOTHING`: a batch sent again after a lost
  commit reply is stored once) and adds exactly the inserted ones to the aggregates. `data` is `json`
  (kept as text: jsonb parses every record on the server, 3× slower to insert).
- Partitions: created `DAYS_AHEAD` days ahead (and for any older day a batch brings, as an import
  does) as a plain table then ATTACHed: SHARE UPDATE EXCLUSIVE on the parent, so writers and readers
  never wait for it. Retention drops whole days: DETACH … CONCURRENTLY then DROP, no DELETE, no bloat.
  A day goes once all of it is older than `--records-max-age`; the optional row cap
  (`--records-max-rows`) drops the oldest days while the others hold that many rows (the planner's
  counts). One replica at a time does it (the retention advisory lock), every `RETAIN_EVERY_S`.
- Schema: versioned in `llmproxy_meta` (`store_version`), created or migrated when a replica opens
  the store under a transaction-level advisory lock (replicas start together); a newer one is refused.
  Schema 1 kept records in the unpartitioned `llmproxy_requests`, which its replicas check as
  `schema_version` 1: that table is left as it is, so a rolling upgrade's old replicas keep writing to
  it, and the retention pass moves its records in (oldest first, `MOVE_CHUNK` at a time, through the
  same write path, within `MOVE_BUDGET_S`) until it is empty. Drop it once no old replica runs.
- The password comes from the URL, `--records-db-password-file` (a mounted Secret, re-read at each
  connect) or libpq's own `PGPASSWORD` / `PGPASSFILE`; log lines name the store by `redact(url)`.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import re
import threading
import time
from typing import Any, Iterator

import orjson
import psycopg

from . import Filters, Rejected, Row, Unavailable
from . import codec
from . import columns as C
from . import sql as A
from .partitions import ROLLUP, TABLE, Partitions

STORE_VERSION = 3  # 3: the tenant and the end user (columns), the rollup's tenant and its sums for a mean request
LEGACY = "llmproxy_requests"  # schema 1's table
MIGRATE_LOCK, RETAIN_LOCK = 0x6C6D7001, 0x6C6D7002  # advisory locks ("lm" p n; 3: partitions.py)
COMPACT_LOCK = 0x6C6D7004  # one per block or hour: (this, its start / its span, + 2^30 for an hour)
RETAIN_EVERY_S = 5.0
MOVE_CHUNK = 5000
BUDGET_S = 2.0  # what one retention pass may spend compacting hours and moving schema 1's records in
NAMES = (*C.COLUMNS, "data")
TYPES: dict[str, str] = {**{c: "float8" for c in C.REALS}, **{c: "integer" for c in C.INTEGERS}, **{c: "text" for c in (*C.DIMENSIONS, *C.TEXTS, "rid")},
         **{c: "bigint" for c in ("key", "ended_ns", "received_ns", "series")}}
COPY_TYPES = [TYPES.get(name, "bytea") for name in NAMES]
INDEXES_V3 = (f"CREATE INDEX IF NOT EXISTS {TABLE}_tenant ON {TABLE} (tenant, ended_ns)",  # a quiet tenant's or a user's newest
              f"CREATE INDEX IF NOT EXISTS {TABLE}_user ON {TABLE} (user_id, ended_ns) WHERE user_id IS NOT NULL")
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS llmproxy_meta (key text PRIMARY KEY, value text NOT NULL)",
    # The records: the typed columns (columns.py: rid, key, the end time that is the partition key, the
    # dimensions, the figures' values, the fits' points, the blamed phases) and the record as JSON text
    # (never parsed by the server: cast data::json to query into it).
    f"CREATE TABLE IF NOT EXISTS {TABLE} ({', '.join(f'{c} {TYPES[c]}' for c in C.COLUMNS)}, data bytea NOT NULL) PARTITION BY RANGE (ended_ns)",
    # Each index grows at its end (by time): a random insert into a large index misses the cache. The samples: a quiet
    # model's read from all its points in the window, a busy one's from a sixteenth of them (sql.py).
    f"CREATE UNIQUE INDEX IF NOT EXISTS {TABLE}_key ON {TABLE} (ended_ns, key)",  # once; the newest first; a batch's range
    f"CREATE INDEX IF NOT EXISTS {TABLE}_model ON {TABLE} (model, upstream, ended_ns) INCLUDE (key, px, py, dx, dy)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_sample ON {TABLE} (model, upstream, ended_ns) INCLUDE (key, px, py, dx, dy) WHERE key < {A.SAMPLED}",
    # The rare rows the list filters on (an instance's, or a common value's, are found newest first).
    f"CREATE INDEX IF NOT EXISTS {TABLE}_failed ON {TABLE} (outcome, ended_ns) WHERE outcome <> 'ok'",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_miss ON {TABLE} (ended_ns) WHERE verdict = 'miss'",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_ttft ON {TABLE} (ttft_s)",
    *INDEXES_V3,
    # The aggregates (sql.py), each keyed by the start of its block or hour (ns), partitioned by day.
    f"""CREATE TABLE IF NOT EXISTS {ROLLUP} (start bigint NOT NULL, series bigint NOT NULL,
        {', '.join(f'{name} text NOT NULL' for name in C.DIMENSIONS)},
        {', '.join(f"{name} {'float8' if name.endswith(A.FLOATS) else 'bigint'}" for name, _, _ in A.SUMS)},
        PRIMARY KEY (start, series)) PARTITION BY RANGE (start)""",
    *(statement for table in A.HISTS.values() for statement in (
        f"""CREATE TABLE IF NOT EXISTS {table} (start bigint NOT NULL, {', '.join(f'{d} text NOT NULL' for d in A.HIST_DIMS)},
            code integer NOT NULL, bucket integer NOT NULL, n bigint NOT NULL) PARTITION BY RANGE (start)""",
        f"CREATE INDEX IF NOT EXISTS {table}_start ON {table} (start)")),
    "CREATE TABLE IF NOT EXISTS llmproxy_compacted (span bigint NOT NULL, start bigint NOT NULL, at_ns bigint NOT NULL, PRIMARY KEY (span, start))",
    "CREATE TABLE IF NOT EXISTS llmproxy_dirty (span bigint NOT NULL, start bigint NOT NULL, PRIMARY KEY (span, start))",
)
# Store version N -> the statements that make it N + 1. 2 -> 3: columns (catalog changes, no rewrite) and two indexes; a
# replica of version 2 still running keeps writing (tenant null; `unknown` in the rollup), one restarted refuses the store.
MIGRATIONS: dict[int, tuple[str, ...]] = {2: (
    f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS tenant text, ADD COLUMN IF NOT EXISTS user_id text, ADD COLUMN IF NOT EXISTS ph_failover float8",
    f"ALTER TABLE {ROLLUP} ADD COLUMN IF NOT EXISTS tenant text NOT NULL DEFAULT 'unknown', "
    + ", ".join(f"ADD COLUMN IF NOT EXISTS {name} {'float8' if name.endswith(A.FLOATS) else 'bigint'}" for name in A.V3_SUMS),
    *INDEXES_V3,
)}
# A batch's rows: the keys in its time range (one index range; keys are hashes of unique ids).
BATCH_ROWS = "ended_ns >= ? AND ended_ns <= ?"
HELD = A.POSTGRES.sql(f"SELECT key, ended_ns FROM {TABLE} WHERE {BATCH_ROWS}")
ADD = A.POSTGRES.sql(A.rollup(A.POSTGRES, f"(SELECT * FROM {TABLE} WHERE {BATCH_ROWS} AND key = ANY(?::bigint[]))"))
KEY, ENDED = C.COLUMNS.index("key"), C.COLUMNS.index("ended_ns")
WORK_MEM = "SET LOCAL work_mem = '64MB'"  # the histograms' hash tables in memory (the server's 4 MB default spills them: 2x slower)


def _lock_key(span: int, start: int) -> int:
    """A block's or an hour's advisory lock (its index: 3 million blocks since the epoch, an int4)."""
    return start // span + (1 << 30 if span == C.HOUR_NS else 0)


def redact(url: str) -> str:
    """The URL with its password replaced: what log lines and errors may show."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def connect(url: str, password_file: str = "", **options: Any) -> psycopg.Connection[Any]:
    """A connection (autocommit: transactions are explicit); the password file, when given, wins. No
    statement is prepared: a prepared one gets a generic plan after five runs, which prunes no
    partition and plans a batch's time range as if it were any (the rollup's statement ran 5x slower)."""
    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": 5, "application_name": "llm-latency-proxy", "prepare_threshold": None,
                              **options}
    if password_file:
        with open(password_file, encoding="utf-8") as handle:
            kwargs["password"] = handle.read().strip()
    return psycopg.connect(url, **kwargs)


def _scrubbed(exc: BaseException, url: str) -> str:
    """An error's text with no password in it, whatever the driver echoed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    password = re.search(r"://[^:/@]+:([^@]*)@", url)
    return redact(text.replace(password.group(1), "***") if password and password.group(1) else text)


def migrate(conn: psycopg.Connection[Any]) -> None:
    """Create the schema or bring it to this version, one replica at a time; refuse a newer one."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
        conn.execute(SCHEMA[0])
        row = conn.execute("SELECT value FROM llmproxy_meta WHERE key = 'store_version'").fetchone()
        version = int(row[0]) if row else 0
        if version > STORE_VERSION:
            raise Unavailable(f"the records store is version {version}, newer than this proxy's {STORE_VERSION}: not written")
        if version == 0:
            for statement in SCHEMA[1:]:
                conn.execute(statement)
        for step in range(version or STORE_VERSION, STORE_VERSION):
            for statement in MIGRATIONS[step]:
                conn.execute(statement)
        conn.execute("INSERT INTO llmproxy_meta (key, value) VALUES ('store_version', %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                     (str(STORE_VERSION),))


class PostgresBackend:
    retain_every_s = RETAIN_EVERY_S

    def __init__(self, url: str, max_rows: int = -1, max_age_s: float = 7 * 86400.0, password_file: str = "", bulk: bool = False) -> None:
        self.url, self.password_file = url, password_file
        # An import's sessions commit without waiting for the WAL flush (synchronous_commit off, theirs
        # only): a server crash loses their last commits, records and aggregates together (one
        # transaction), and the import run again stores them (it skips the ids already held).
        self.session = "-c statement_timeout=30000" + (" -c synchronous_commit=off" if bulk else "")
        self.where = redact(url)
        self.max_rows = max(0, max_rows)  # (the default, -1: no row cap; age alone bounds the store)
        self.max_age_s = max_age_s
        self.conn: psycopg.Connection[Any] | None = None  # the writer's
        self.partitions = Partitions()
        self._readers: list[psycopg.Connection[Any] | None] = [None, None]
        self._reader_locks = (threading.Lock(), threading.Lock())

    def _connect(self, **options: Any) -> psycopg.Connection[Any]:
        try:
            return connect(self.url, self.password_file, **options)
        except psycopg.Error as exc:
            raise Unavailable(_scrubbed(exc, self.url)) from None
        except OSError as exc:  # the password file
            raise Unavailable(f"{self.password_file}: {exc.strerror or exc}") from None

    def open(self) -> None:
        conn = self._connect(options=self.session)
        try:
            migrate(conn)
            self.partitions = Partitions()
            self.partitions.ahead(conn)
        except psycopg.Error as exc:
            conn.close()
            raise Unavailable(_scrubbed(exc, self.url)) from None
        self.conn = conn

    def write(self, rows: list[Row]) -> int:
        conn = self.conn
        assert conn is not None
        try:
            values = [(*C.values(r.rid, record), codec.pack(r.data)) for r in rows for record in (r.parsed(),)]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise Rejected(f"not a record: {exc}") from None
        try:
            self.partitions.ensure(conn, {row.ended_ns // C.DAY_NS for row in rows})
            with conn.transaction():
                return self._insert(conn, values)
        except psycopg.errors.UniqueViolation as exc:  # another writer stored some of them meanwhile: again, skipping those
            self.close()
            raise Unavailable(_scrubbed(exc, self.url)) from None
        except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as exc:  # what these rows hold
            raise Rejected(_scrubbed(exc, self.url)) from None
        except psycopg.Error as exc:  # down, restarting, slow, the table gone: reconnect (and migrate) and retry
            self.close()
            raise Unavailable(_scrubbed(exc, self.url)) from None

    @staticmethod
    def _insert(conn: psycopg.Connection[Any], values: list[tuple[Any, ...]]) -> int:
        """Inside a transaction: the rows the store does not hold yet, COPYed in, and added to the
        rollup; the blocks and hours a compaction may have read marked dirty. How many were new."""
        ended = [v[ENDED] for v in values]
        keys = [_lock_key(span, start) for span, start in A.units(ended)]  # (a compaction of them waits for this batch, or it for one)
        conn.execute("SELECT pg_advisory_xact_lock_shared(%s, k) FROM unnest(%s::int[]) AS k", (COMPACT_LOCK, keys))
        span = (min(ended), max(ended))
        held = set(conn.execute(HELD, span).fetchall())
        new = [v for v in values if (v[KEY], v[ENDED]) not in held] if held else values
        if not new:
            return 0
        with conn.cursor().copy(f"COPY {TABLE} ({', '.join(NAMES)}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(COPY_TYPES)
            for value in new:
                copy.write_row(value)
        conn.execute(ADD, (*span, "{" + ",".join(str(v[KEY]) for v in new) + "}"))  # (an array literal: 50x cheaper to send than a list)
        late = A.dirty((v[ENDED] for v in new), time.time_ns())
        if late:
            conn.cursor().executemany("INSERT INTO llmproxy_dirty (span, start) VALUES (%s, %s) ON CONFLICT DO NOTHING", late)
        return len(new)

    def retain(self) -> None:
        """One replica at a time: partitions ahead, whole days dropped past the age and row limits, the
        hours due compacted, and schema 1's records moved in, within BUDGET_S."""
        conn = self.conn
        if conn is None:
            return
        try:
            if not conn.execute("SELECT pg_try_advisory_lock(%s)", (RETAIN_LOCK,)).fetchone()[0]:  # type: ignore[index]
                return  # another replica is at it
            try:
                self.partitions.ahead(conn)
                for name in self.partitions.expired(conn, self.max_age_s, self.max_rows):
                    self.partitions.drop(conn, name)
                for table in ("llmproxy_compacted", "llmproxy_dirty"):  # (what the dropped days' aggregates were)
                    conn.execute(f"DELETE FROM {table} WHERE start < %s", (self.partitions.oldest(conn),))
                began = time.monotonic()
                while time.monotonic() - began < BUDGET_S and (self._compact_one(conn) or self._move(conn)):
                    pass
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (RETAIN_LOCK,))
        except psycopg.Error as exc:
            self.close()
            raise Unavailable(_scrubbed(exc, self.url)) from None

    def compact(self, before_ns: int = A.INF_NS) -> int:
        """Every block and hour due (ending before `before_ns`), now: how many (an import's)."""
        conn = self.conn
        assert conn is not None
        done = 0
        while self._compact_one(conn, before_ns):
            done += 1
        return done

    @staticmethod
    def _compact_one(conn: psycopg.Connection[Any], before_ns: int = A.INF_NS) -> bool:
        @contextlib.contextmanager
        def transaction(span: int, start: int) -> Iterator[None]:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (COMPACT_LOCK, _lock_key(span, start)))  # (its writers hold the shared side)
                conn.execute(WORK_MEM)
                yield

        return A.compact_next(conn, A.POSTGRES, transaction, time.time_ns(), before_ns)

    def _move(self, conn: psycopg.Connection[Any]) -> bool:
        """One chunk of schema 1's records into this schema, and out of its table, in one transaction."""
        if conn.execute("SELECT to_regclass(%s)", (LEGACY,)).fetchone()[0] is None:  # type: ignore[index]
            return False
        with conn.transaction():
            rows = conn.execute(f"SELECT id, rid, data::text FROM {LEGACY} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED", (MOVE_CHUNK,)).fetchall()
            if not rows:
                return False
            values = []
            for _, rid, data in rows:
                record = orjson.loads(data)
                record["id"] = rid
                values.append((*C.values(rid, record), codec.pack(orjson.dumps(record))))
            self.partitions.ensure(conn, {value[ENDED] // C.DAY_NS for value in values})
            self._insert(conn, values)
            conn.execute(f"DELETE FROM {LEGACY} WHERE id = ANY(%s)", ([row[0] for row in rows],))
        return True

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error:
                pass  # (already broken: closing it is all that was left)
            self.conn = None

    # Readers: two connections, kept (a connection costs a password exchange: /ui asks every 2 s), one
    # reader at a time on each (a window's read uses both at once); dropped when one fails, made again
    # by the next read.

    @contextlib.contextmanager
    def _reading(self, second: bool = False) -> Iterator[psycopg.Connection[Any] | None]:
        """The readers' connection (or their second); None while no replica of this version has written."""
        index = int(second)
        with self._reader_locks[index]:
            conn = self._readers[index]
            if conn is None or conn.closed:
                conn = self._readers[index] = connect(self.url, self.password_file)
            try:
                yield conn if conn.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is not None else None  # type: ignore[index]
            except psycopg.Error:
                conn.close()
                raise

    def _read(self, sql: str, args: list[Any] | tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._reading() as conn:
            return conn.execute(sql, args).fetchall() if conn is not None else []

    def recent(self, limit: int, filters: Filters) -> list[bytes]:
        """The fleet's newest `limit` records, oldest first (every replica's; `instance` selects one)."""
        where, args = _where(filters)
        rows = self._read(f"SELECT data FROM {TABLE}{where} ORDER BY ended_ns DESC LIMIT %s", (*args, max(0, limit)))
        return [codec.unpack(row[0]) for row in reversed(rows)]

    def aggregate(self, by: tuple[str, ...], window: A.Window, cells: bool = True) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        with self._reading() as conn:
            if conn is None:
                return [], []
            if not cells:
                ((sums, sargs),) = A.queries(A.POSTGRES, by, window)
                return conn.execute(sums, sargs).fetchall(), []
            with conn.transaction():  # (one snapshot for the plan and both reads)
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                conn.execute(WORK_MEM)
                return self._read_window(conn, by, window)

    def _read_window(self, conn: psycopg.Connection[Any], by: tuple[str, ...], window: A.Window) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """The sums here; the parts of the histograms (the records' edges, the compacted blocks) split
        between this connection and a second one, at once: the server counts on both cores."""
        clean = conn.execute(A.POSTGRES.sql(A.CLEAN), (window.first_block,)).fetchall()
        (sums, sargs), *parts = A.queries(A.POSTGRES, by, window, A.halved(A.plan(window, clean), time.time_ns()))
        with self._reading(second=True) as other:
            def run(chunk: list[tuple[str, list[Any]]]) -> list[tuple[Any, ...]]:
                assert other is not None
                with other.transaction():
                    other.execute(WORK_MEM)
                    return [row for text, args in chunk for row in other.execute(text, args).fetchall()]

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                theirs = pool.submit(run, parts[1::2])
                rows = conn.execute(sums, sargs).fetchall()
                cells = [row for text, args in parts[0::2] for row in conn.execute(text, args).fetchall()]
                return rows, cells + theirs.result()

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
        with connect(self.url, self.password_file) as conn:
            if conn.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is None:  # type: ignore[index]
                return
            with conn.transaction(), conn.cursor(name="llmproxy_export") as cursor:
                cursor.itersize = 5000
                cursor.execute(f"SELECT data FROM {TABLE} WHERE ended_ns >= %s ORDER BY ended_ns", (start_ns,))
                for (data,) in cursor:
                    yield codec.unpack(data)

    def pending(self) -> int:
        with connect(self.url, self.password_file) as conn:
            if conn.execute("SELECT to_regclass(%s)", (LEGACY,)).fetchone()[0] is None:  # type: ignore[index]
                return 0
            return int(conn.execute(f"SELECT count(*) FROM {LEGACY}").fetchone()[0])  # type: ignore[index]


def _where(filters: Filters) -> tuple[str, list[Any]]:
    where = [f"{name} = %s" for name, _ in filters.equal()]
    args: list[Any] = [value for _, value in filters.equal()]
    if filters.user:
        where.append("user_id = %s")
        args.append(filters.user)
    if filters.min_ttft:
        where.append("ttft_s >= %s")
        args.append(filters.min_ttft)
    return (f" WHERE {' AND '.join(where)}" if where else ""), args
