"""Durable per-request records: an embedded SQLite database, written off the request path.

Why SQLite: Prometheus histograms lose the joint distribution (prompt length, output length,
concurrency and timings of one request), which `explain` needs; a file per replica needs no
server. The finisher hands each finished record to `RecordStore.add` (a queue put); one writer
thread inserts them in batches, in WAL mode so every worker process can write to the same file
and readers never block writers. Retention (rows and age) is enforced by the writer after each
batch (two indexed deletes). A locked, full or corrupt file is logged once and counted
(`llmproxy_telemetry_errors_total{component="records"}`); the relay never waits on disk and never
sees the error. Records hold timings and counts only: no credential, no prompt or completion text.
"""
from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

log = logging.getLogger("llmproxy.records")

SCHEMA_VERSION = 1
BATCH = 500  # rows per transaction at most
FLUSH_S = 0.25  # how long a record may wait for its batch
# Indexed columns for the filters `explain` and /llmproxy/requests use; the whole record is `data`.
COLUMNS = ("ended_ns", "pid", "model", "upstream", "endpoint", "stream", "outcome", "data")
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    ended_ns INTEGER NOT NULL,  -- wall clock (epoch ns) when the request ended
    pid INTEGER NOT NULL,       -- the worker process that served it
    model TEXT NOT NULL, upstream TEXT NOT NULL, endpoint TEXT NOT NULL, stream INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    data BLOB NOT NULL          -- the record as JSON (proxy.telemetry.record_dict)
);
CREATE INDEX IF NOT EXISTS requests_ended ON requests (ended_ns);
CREATE INDEX IF NOT EXISTS requests_model ON requests (model, upstream, ended_ns);
"""
_STOP = object()


def default_path(port: int) -> str:
    """In the user's data directory (XDG), one file per listening port: the workers of one proxy
    share it; two proxies on one machine do not mix their records."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "llm-latency-proxy" / f"records-{port}.sqlite")


def connect(path: str, timeout: float = 5.0) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=timeout, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


def migrate(db: sqlite3.Connection) -> None:
    """Create the schema, or refuse a file written by a newer version (never rewrite it)."""
    db.executescript(SCHEMA)
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    elif int(row[0]) > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"records schema version {row[0]} is newer than this proxy's {SCHEMA_VERSION}")


class RecordStore:
    """One writer thread per process; `add` is the only call on the request side."""

    def __init__(self, path: str, max_rows: int, max_age_s: float, on_error: Callable[[], None], busy_timeout_s: float = 5.0) -> None:
        self.path, self.max_rows, self.max_age_s, self.busy_timeout_s = path, max_rows, max_age_s, busy_timeout_s
        self.on_error = on_error
        self.written = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._logged = False
        self._thread = threading.Thread(target=self._run, name="llmproxy-records", daemon=True)
        self._thread.start()

    def add(self, record: dict[str, Any], model: str, upstream: str) -> None:
        self._queue.put((time.time_ns(), os.getpid(), model, upstream, record["endpoint"], int(bool(record["stream"])),
                         record["outcome"], record))

    def flush(self, timeout: float = 2.0) -> None:
        """Wait until every record added so far is written (or failed): a read after it sees them."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop (the server's shutdown)."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _failed(self, exc: BaseException) -> None:
        self.on_error()
        if not self._logged:
            self._logged = True
            log.error("per-request records could not be written to %s: %s (counted in "
                      "llmproxy_telemetry_errors_total{component=\"records\"}; requests are unaffected)", self.path, exc)

    def _open(self) -> sqlite3.Connection | None:
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = connect(self.path, self.busy_timeout_s)
            migrate(db)
            return db
        except (sqlite3.Error, OSError) as exc:
            self._failed(exc)
            return None

    def _run(self) -> None:
        db, stopping = self._open(), False
        while not stopping:
            rows: list[tuple[Any, ...]] = []
            waiting: list[threading.Event] = []  # flush() calls answered once this batch is written
            item = self._queue.get()
            deadline = time.monotonic() + FLUSH_S
            while True:
                if item is _STOP:
                    stopping = True
                    break
                if isinstance(item, threading.Event):
                    waiting.append(item)
                    break
                rows.append(item)
                if len(rows) >= BATCH:
                    break
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
            if rows and db is None:
                db = self._open()  # a file that was locked or missing may be fine now
            if rows and db is None:
                for _ in rows:
                    self.on_error()  # each lost record is counted
            elif rows and db is not None:
                try:
                    self._insert(db, rows)
                    self._retain(db)
                except (sqlite3.Error, OSError, ValueError, TypeError) as exc:
                    self._failed(exc)
                    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
                        db.close()
                        db = None  # corrupt: reopen (and fail, counted) next time
            for event in waiting:
                event.set()
        if db is not None:
            db.close()

    def _insert(self, db: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
        values = [(*row[:7], orjson.dumps(row[7])) for row in rows]
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", values)
        self.written += len(rows)

    def _retain(self, db: sqlite3.Connection) -> None:
        """Keep at most max_rows rows, none older than max_age_s."""
        with db:
            db.execute("BEGIN IMMEDIATE")
            if self.max_age_s > 0:
                db.execute("DELETE FROM requests WHERE ended_ns < ?", (time.time_ns() - int(self.max_age_s * 1e9),))
            if self.max_rows > 0:
                db.execute("DELETE FROM requests WHERE id <= (SELECT id FROM requests ORDER BY id DESC LIMIT 1 OFFSET ?)", (self.max_rows,))


@dataclass(frozen=True)
class Filters:
    """What /llmproxy/requests (and /ui) may select by; empty: any. `verdict`: good or miss."""

    model: str = ""
    upstream: str = ""
    outcome: str = ""
    api: str = ""
    slo: str = ""
    verdict: str = ""

    def match(self, record: dict[str, Any]) -> bool:
        """The same selection on a record in memory (records off)."""
        return all(not want or record.get(name) == want for name, want in
                   (("model", self.model), ("upstream", self.upstream), ("outcome", self.outcome), ("api", self.api), ("slo", self.slo))) \
            and (not self.verdict or record.get("slo_good") is (self.verdict == "good"))

    def where(self) -> tuple[str, list[Any]]:
        where: list[str] = []
        args: list[Any] = []
        for column, value in (("model", self.model), ("upstream", self.upstream), ("outcome", self.outcome),
                              ("json_extract(data, '$.api')", self.api), ("json_extract(data, '$.slo')", self.slo)):
            if value:
                where.append(f"{column} = ?")
                args.append(value)
        if self.verdict:
            where.append("json_extract(data, '$.slo_good') = ?")
            args.append(1 if self.verdict == "good" else 0)
        return (f"WHERE {' AND '.join(where)}" if where else ""), args


def recent(path: str, limit: int, filters: Filters = Filters()) -> list[dict[str, Any]]:
    """The newest `limit` records (every worker's), oldest first: for /llmproxy/requests and /ui."""
    clause, args = filters.where()
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        rows = db.execute(f"SELECT data FROM requests {clause} ORDER BY id DESC LIMIT ?", (*args, max(0, limit))).fetchall()
    finally:
        db.close()
    return [orjson.loads(row[0]) for row in reversed(rows)]
