"""The embedded records store: one SQLite file per listening port, in WAL mode, so every worker
process writes to the same file and readers never block writers.

The same design as the fleet's PostgreSQL (aggregate.py, columns.py): the records with their typed
columns and cells, and the hourly aggregates written in the same transaction, so `explain` over a
day reads thousands of rows. Retention (rows and age) runs every `RETAIN_EVERY_S`, in the writer's
maintenance thread, on a connection of its own, each step a short transaction: indexed deletes of
the records, and of the aggregates by age only (the row cap trims what a record holds, not what was
counted). A locked or full file is Unavailable (its rows wait in the buffer, written once it is
free); a corrupt one, or one written by a newer version (refused, never rewritten), too: counted and
logged, never a request's problem.

Schema 1 kept every record as JSON in `requests`; schema 2 keeps them in `llmproxy_records`. A file
of schema 1 is moved in place, `MOVE_CHUNK` records at a time within `MOVE_BUDGET_S` at each
retention pass, oldest first, through the same write path; `meta.schema_version` stays 1 so that a
proxy of the older version still running on the file (a restart) keeps writing to `requests`, and
its records are moved in too (`meta.store_version` is this schema's version).
"""
from __future__ import annotations

import contextlib
import math
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson

from . import Filters, Rejected, Row, Unavailable
from . import boots
from . import codec
from . import columns as C
from . import sql as A
from .aggregate import Fold
from .migration import BOOTS, Newer

STORE_VERSION = 6  # the level (migration.py has what each brought), the same as the fleet store's
WRITERS_FROM = 3  # written as store_version: the oldest writers that take this file as it is
DEFAULT_MAX_ROWS = 1_000_000
RETAIN_EVERY_S = 1.0
MOVE_CHUNK = 5000
BUDGET_S = 1.0  # what one retention pass may spend compacting hours and moving schema 1's records in
NAMES = (*C.COLUMNS, "data")
TYPES = {**{c: "REAL" for c in C.REALS}, **{c: "INTEGER" for c in (*C.INTEGERS, "key", "ended_ns", "received_ns", "series")},
         **{c: "TEXT" for c in (*C.DIMENSIONS, *C.TEXTS, "rid")}}
SUM_COLUMNS = ", ".join(f"{name} {'REAL' if name.endswith(A.FLOATS) else 'INTEGER'}" for name, _, _ in A.SUMS)
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS llmproxy_records (
    id INTEGER PRIMARY KEY,     -- insertion order: a batch's new rows are those above the last id before it
    {', '.join(f'{c} {TYPES[c]}' for c in C.COLUMNS)},  -- columns.py
    data BLOB NOT NULL          -- the record's JSON (proxy.measure.context.record_dict, with its id), compressed (codec.py)
);
CREATE UNIQUE INDEX IF NOT EXISTS llmproxy_records_key ON llmproxy_records (ended_ns, key);
CREATE INDEX IF NOT EXISTS llmproxy_records_model ON llmproxy_records (model, upstream, ended_ns, key, px, py, dx, dy);
CREATE INDEX IF NOT EXISTS llmproxy_records_sample ON llmproxy_records (model, upstream, ended_ns, key, px, py, dx, dy) WHERE key < {A.SAMPLED};
CREATE INDEX IF NOT EXISTS llmproxy_records_tenant ON llmproxy_records (tenant, ended_ns);
CREATE INDEX IF NOT EXISTS llmproxy_records_user ON llmproxy_records (user_id, ended_ns) WHERE user_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS llmproxy_rollup (start INTEGER NOT NULL, series INTEGER NOT NULL,
    {', '.join(f'{name} TEXT NOT NULL' for name in C.DIMENSIONS)}, {SUM_COLUMNS}, PRIMARY KEY (start, series)) WITHOUT ROWID;
""" + "".join(f"""CREATE TABLE IF NOT EXISTS {table} (start INTEGER NOT NULL, {', '.join(f'{d} TEXT NOT NULL' for d in A.HIST_DIMS)},
    code INTEGER NOT NULL, bucket INTEGER NOT NULL, n INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS {table}_start ON {table} (start);
""" for table in A.HISTS.values()) + """
CREATE TABLE IF NOT EXISTS llmproxy_compacted (span INTEGER NOT NULL, start INTEGER NOT NULL, at_ns INTEGER NOT NULL, PRIMARY KEY (span, start));
CREATE TABLE IF NOT EXISTS llmproxy_dirty (span INTEGER NOT NULL, start INTEGER NOT NULL, PRIMARY KEY (span, start));
""" + BOOTS + ";\n"
INSERT = (f"INSERT INTO llmproxy_records ({', '.join(NAMES)}) VALUES ({', '.join('?' * len(NAMES))}) "
          "ON CONFLICT (ended_ns, key) DO NOTHING")
ADD = A.rollup(A.SQLITE, "(SELECT * FROM llmproxy_records WHERE id > ?)")
ENDED = C.COLUMNS.index("ended_ns")


def connect(path: str, timeout: float = 5.0, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout, check_same_thread=False)
    db = sqlite3.connect(path, timeout=timeout, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


# Level N -> the statements that make it N + 1 (columns and tables added: an older file keeps its rows, and its
# writers still write).
MIGRATIONS = {2: ("ALTER TABLE llmproxy_records ADD COLUMN tenant TEXT", "ALTER TABLE llmproxy_records ADD COLUMN user_id TEXT",
                  "ALTER TABLE llmproxy_records ADD COLUMN ph_failover REAL",
                  "ALTER TABLE llmproxy_rollup ADD COLUMN tenant TEXT NOT NULL DEFAULT 'unknown'",
                  *(f"ALTER TABLE llmproxy_rollup ADD COLUMN {name} {'REAL' if name.endswith(A.FLOATS) else 'INTEGER'}" for name in A.V3_SUMS)),
              3: (BOOTS,),
              4: ("ALTER TABLE llmproxy_records ADD COLUMN model_name TEXT",),
              5: ("ALTER TABLE llmproxy_records ADD COLUMN ph_lag REAL", *(f"ALTER TABLE llmproxy_rollup ADD COLUMN {name} REAL" for name in A.V6_SUMS))}


def migrate(db: sqlite3.Connection) -> None:
    """In the caller's transaction, all or nothing: create this schema beside an older one (moved in by the
    maintenance pass), bring an older level of it up (`MIGRATIONS`), or refuse a file that takes newer writers
    only (never rewrite it). (No executescript: it would commit the transaction first.)"""
    has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone() is not None
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall()) if has_meta else {}
    floor = int(meta.get("store_version", 0))
    level = int(meta.get("store_level", floor))
    if floor > STORE_VERSION:
        raise Newer(f"the records file takes writers of version {floor} or newer and this proxy writes version {STORE_VERSION}: "
                    "upgrade it (its records wait in its buffer meanwhile, the oldest dropped past it, counted)")
    for step in range(level or STORE_VERSION, STORE_VERSION):
        for statement in MIGRATIONS[step]:
            db.execute(statement)
    for statement in SCHEMA.split(";\n"):
        if statement.strip():
            db.execute(statement)
    for key, value in (("store_level", STORE_VERSION), ("store_version", max(floor, WRITERS_FROM))):
        db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, str(value)))


def _legacy(db: sqlite3.Connection) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'requests'").fetchone() is not None


class SQLiteBackend:
    retain_every_s = RETAIN_EVERY_S

    def __init__(self, path: str, max_rows: int = -1, max_age_s: float = 7 * 86400.0, busy_timeout_s: float = 5.0, max_models: int = 100,
                 known_models: tuple[str, ...] = ()) -> None:
        self.path = self.where = path
        self.columns = C.Columns(max_models, known_models)  # (the rollup's model names; the figures checked, counted)
        self.max_rows = DEFAULT_MAX_ROWS if max_rows < 0 else max_rows
        self.max_age_s, self.busy_timeout_s = max_age_s, busy_timeout_s
        self.db: sqlite3.Connection | None = None  # the writer's
        self.maint: sqlite3.Connection | None = None  # the maintenance thread's
        self.moved_bad = 0  # schema 1's rows that were no record (dropped while moving them in: the writer counts them)
        self.tally: Callable[[], boots.Tally] | None = None  # the writer's own figures (records.Writer sets it; an import has none)
        self.step = "connect"  # the maintenance step under way (a failure is counted as it)

    def open(self) -> None:
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = connect(self.path, self.busy_timeout_s)
            with db:
                db.execute("BEGIN IMMEDIATE")
                migrate(db)
        except (sqlite3.Error, OSError, Newer) as exc:
            raise Unavailable(str(exc)) from None
        self.db = db

    def write(self, rows: list[Row]) -> int:
        db = self.db
        assert db is not None
        try:
            values = [self.columns.row(r.rid, r.parsed(), r.data) for r in rows]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise Rejected(f"not a record: {exc}") from None
        return self._insert(db, values)

    def _insert(self, db: sqlite3.Connection, values: list[tuple[Any, ...]], then: tuple[str, tuple[Any, ...]] | None = None) -> int:
        """Rows and their rollup in one transaction (and `then`, a statement of the same one), what a compaction
        read of them marked dirty (sql.dirty) and the writer's boot moved on (boots.py); only the rows really
        inserted count, and how many they were is returned."""
        try:
            with db:
                db.execute("BEGIN IMMEDIATE")
                before = db.execute("SELECT coalesce(max(id), 0) FROM llmproxy_records").fetchone()[0]
                db.executemany(INSERT, values)
                db.execute(ADD, (before,))
                if values:
                    db.execute(*A.dirty(A.SQLITE, (v[ENDED] for v in values)))
                if then is not None:
                    db.execute(*then)
                stored = int(db.execute("SELECT count(*) FROM llmproxy_records WHERE id > ?", (before,)).fetchone()[0])
                if self.tally is not None and then is None:
                    db.execute(*boots.upsert(A.SQLITE, self.tally(), stored, time.time_ns()))
                return stored
        except sqlite3.OperationalError as exc:  # locked, full, read-only: the same rows may go in later
            raise Unavailable(str(exc)) from None
        except sqlite3.IntegrityError as exc:
            raise Rejected(str(exc)) from None
        except sqlite3.DatabaseError as exc:  # corrupt: reopen (and fail, counted) next time
            self.close()
            raise Unavailable(str(exc)) from None

    def maintain(self) -> tuple[int, int]:
        """The maintenance thread's pass, on its own connection: at most max_rows records, none older than
        max_age_s, the aggregates by age, the blocks' histograms past BLOCKS_KEPT_S with what said they were
        compacted; then the hours due compacted and what an older schema holds moved in, for at most BUDGET_S;
        this writer's boot seen, the boots of writers gone accounted. (What they lost; schema 1's rows that
        were no record.) Each step its own short transaction: the writer waits for none of them long."""
        try:
            db, self.step = self.maint, "connect"
            if db is None:
                db = self.maint = connect(self.path, self.busy_timeout_s)
            now, self.step = time.time_ns(), "boots"  # (one machine, one clock)
            with db:
                db.execute("BEGIN IMMEDIATE")
                tally = self.tally() if self.tally is not None else None
                lost = (boots.seen(db, A.SQLITE, tally, now) if tally else 0) + boots.account(db, A.SQLITE, now, tally.boot if tally else "")
            self.step = "retention"
            with db:
                db.execute("BEGIN IMMEDIATE")
                if self.max_age_s > 0:
                    cutoff = now - int(self.max_age_s * 1e9)
                    db.execute("DELETE FROM llmproxy_records WHERE ended_ns < ?", (cutoff,))
                    for table in ("llmproxy_rollup", "llmproxy_hist", "llmproxy_compacted", "llmproxy_dirty"):
                        db.execute(f"DELETE FROM {table} WHERE start < ?", (cutoff - cutoff % C.HOUR_NS,))
                kept = now - int(A.BLOCKS_KEPT_S * 1e9)
                db.execute("DELETE FROM llmproxy_hist_block WHERE start < ?", (kept,))
                db.execute(f"DELETE FROM llmproxy_compacted WHERE span = {A.BLOCK_NS} AND start < ?", (kept,))
                if self.max_rows > 0:
                    # Ids are max(id) + 1 and deletes only take the oldest, so the newest max_rows are
                    # those above max(id) - max_rows, found in the index at once.
                    db.execute("DELETE FROM llmproxy_records WHERE id <= (SELECT max(id) FROM llmproxy_records) - ?", (self.max_rows,))
            began, self.step = time.monotonic(), "compaction"
            self._compact(db, budget_s=BUDGET_S)
            self.step = "migration"
            while time.monotonic() - began < BUDGET_S and _legacy(db) and self._move(db):
                pass
            bad, self.moved_bad = self.moved_bad, 0
            return lost, bad
        except sqlite3.Error as exc:
            if self.maint is not None:
                self.maint.close()
                self.maint = None
            raise Unavailable(str(exc)) from None

    def closed(self, clean: bool = True) -> bool:
        """The writer stops: its boot closed with its last figures (not `clean`: left running, for a pass to account).
        False where its row could not be written: what it could not write is then the next pass's to count, as lost."""
        if self.db is None or self.tally is None:
            return self.tally is None
        try:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                boots.close(self.db, A.SQLITE, self.tally(), time.time_ns(), clean)
            return True
        except sqlite3.Error:
            return False

    def compact(self, before_ns: int = A.INF_NS) -> int:
        """Every block and hour due (ending before `before_ns`), now: how many (an import's)."""
        db = self.db
        assert db is not None
        return self._compact(db, before_ns)

    @staticmethod
    def _compact(db: sqlite3.Connection, before_ns: int = A.INF_NS, budget_s: float = math.inf) -> int:
        @contextlib.contextmanager
        def transaction(span: int, start: int) -> Iterator[bool]:
            with db:
                db.execute("BEGIN IMMEDIATE")  # (one writer of the file at a time: a unit is never another's meanwhile)
                yield True

        return A.compact(db, A.SQLITE, transaction, time.time_ns, before_ns, budget_s)  # (one machine, one clock)

    def _move(self, db: sqlite3.Connection) -> bool:
        """One chunk of schema 1's records into this schema (named `instance/v1/id`), in one transaction; a row
        that is no record is dropped with them (counted in `moved_bad`)."""
        rows = db.execute("SELECT id, data FROM requests ORDER BY id LIMIT ?", (MOVE_CHUNK,)).fetchall()
        if not rows:
            return False
        values = []
        for legacy_id, data in rows:
            try:
                record = orjson.loads(data)
                record.setdefault("instance", "")
                record["id"] = rid = f"{record['instance']}/v1/{legacy_id}"
                values.append(self.columns.row(rid, record))
            except (ValueError, TypeError, KeyError, AttributeError):
                self.moved_bad += 1
        self._insert(db, values, ("DELETE FROM requests WHERE id <= ?", (rows[-1][0],)))
        return True

    def close(self) -> None:
        for attribute in ("db", "maint"):
            db = getattr(self, attribute)
            if db is not None:
                db.close()
                setattr(self, attribute, None)

    # Readers: a read-only connection each (WAL: they never block the writers).

    def _read(self, sql: str, args: list[Any] | tuple[Any, ...]) -> list[tuple[Any, ...]]:
        db = connect(self.path, 5.0, readonly=True)
        try:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'llmproxy_records'").fetchone():
                return []  # nothing written by this version yet
            return db.execute(sql, args).fetchall()
        finally:
            db.close()

    def recent(self, limit: int, filters: Filters) -> list[bytes]:
        """The newest `limit` records (every worker's), oldest first: for /llmproxy/requests and /ui."""
        where, args = _where(filters)
        rows = self._read(f"SELECT data FROM llmproxy_records{where} ORDER BY ended_ns DESC LIMIT ?", (*args, max(0, limit)))
        return [codec.unpack(row[0]) for row in reversed(rows)]

    def aggregate(self, into: Fold, window: A.Window, cells: bool = True) -> None:
        db = connect(self.path, 5.0, readonly=True)
        try:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'llmproxy_records'").fetchone():
                return  # nothing written by this version yet
            if not cells:
                ((sums, sargs),) = A.queries(A.SQLITE, into.by, window)
                into.sums(db.execute(sums, sargs))
                return
            with db:  # (one snapshot for the plan and both reads)
                db.execute("BEGIN")
                clean = db.execute(A.CLEAN, (window.first_block, A.kept_from(time.time_ns()))).fetchall()
                (sums, sargs), *parts = A.queries(A.SQLITE, into.by, window, A.plan(window, clean))
                into.sums(db.execute(sums, sargs))
                for text, args in parts:
                    into.cells(db.execute(text, args))
        finally:
            db.close()

    def samples(self, wanted: list[tuple[str, str, str, int]], window: A.Window) -> list[list[tuple[int, float, float]]]:
        db = connect(self.path, 5.0, readonly=True)
        try:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'llmproxy_records'").fetchone():
                return [[] for _ in wanted]
            return [A.sampled(db, A.SQLITE, fit, model, upstream, points, window) for fit, model, upstream, points in wanted]
        finally:
            db.close()

    def export(self, start_ns: int) -> Iterator[bytes]:
        db = connect(self.path, 5.0, readonly=True)
        try:
            if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'llmproxy_records'").fetchone():
                for (data,) in db.execute("SELECT data FROM llmproxy_records WHERE ended_ns >= ? ORDER BY ended_ns", (start_ns,)):
                    yield codec.unpack(data)
        finally:
            db.close()

    def pending(self) -> int:
        db = connect(self.path, 5.0, readonly=True)
        try:
            return db.execute("SELECT count(*) FROM requests").fetchone()[0] if _legacy(db) else 0
        finally:
            db.close()


def _where(filters: Filters) -> tuple[str, list[Any]]:
    return filters.where("?")
