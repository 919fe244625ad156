"""The embedded records store: one SQLite file per listening port, in WAL mode, so every worker
process writes to the same file and readers never block writers.

Retention (rows and age) runs after each batch (the writer's `retain_every_s` is 0): two indexed deletes. A locked or full file is
Unavailable (its rows wait in the buffer, written once it is free); a corrupt one, or one written
by a newer version (refused, never rewritten), too: counted and logged, never a request's problem.
"""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from . import Filters, Rejected, Row, Unavailable

SCHEMA_VERSION = 1
# Indexed columns for the filters `explain` and /llmproxy/requests use; the whole record is `data`
# (whose `instance`, `api` and `slo` fields the filters read with json_extract).
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


class SQLiteBackend:
    def __init__(self, path: str, max_rows: int, max_age_s: float, busy_timeout_s: float = 5.0) -> None:
        self.path = self.where = path
        self.max_rows, self.max_age_s, self.busy_timeout_s = max_rows, max_age_s, busy_timeout_s
        self.db: sqlite3.Connection | None = None

    def open(self) -> None:
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = connect(self.path, self.busy_timeout_s)
            migrate(db)
        except (sqlite3.Error, OSError) as exc:
            raise Unavailable(str(exc)) from None
        self.db = db

    def write(self, rows: list[Row]) -> None:
        db = self.db
        assert db is not None
        values = [(r.ended_ns, r.pid, r.model, r.upstream, r.endpoint, int(r.stream), r.outcome, r.data) for r in rows]
        try:
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany(f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", values)
        except sqlite3.OperationalError as exc:  # locked, full, read-only: the same rows may go in later
            raise Unavailable(str(exc)) from None
        except sqlite3.DatabaseError as exc:  # corrupt: reopen (and fail, counted) next time
            self.close()
            raise Unavailable(str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise Rejected(str(exc)) from None

    def retain(self) -> None:
        """Keep at most max_rows rows, none older than max_age_s (after every batch: two index lookups)."""
        db = self.db
        if db is None:
            return
        try:
            with db:
                db.execute("BEGIN IMMEDIATE")
                if self.max_age_s > 0:
                    db.execute("DELETE FROM requests WHERE ended_ns < ?", (time.time_ns() - int(self.max_age_s * 1e9),))
                if self.max_rows > 0:
                    # SQLite numbers rows max(id) + 1 and deletes only from the oldest end, so the ids
                    # are (nearly) contiguous: the newest max_rows are those above max(id) - max_rows,
                    # found in the index at once (the OFFSET walk this replaces read the whole table,
                    # every batch: 9% of the CPU of a busy proxy here).
                    db.execute("DELETE FROM requests WHERE id <= (SELECT max(id) FROM requests) - ?", (self.max_rows,))
        except sqlite3.Error as exc:
            raise Unavailable(str(exc)) from None

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    def recent(self, limit: int, filters: Filters) -> list[dict[str, Any]]:
        return recent(self.path, limit, filters)


INDEXED = ("model", "upstream", "outcome")  # filters on a column; the others read the record's JSON


def _where(filters: Filters) -> tuple[str, list[Any]]:
    where: list[str] = []
    args: list[Any] = []
    for name, value in filters.equal():
        where.append(f"{name} = ?" if name in INDEXED else f"json_extract(data, '$.{name}') = ?")
        args.append(value)
    if filters.verdict:
        where.append("json_extract(data, '$.slo_good') = ?")
        args.append(1 if filters.verdict == "good" else 0)
    return (f"WHERE {' AND '.join(where)}" if where else ""), args


def recent(path: str, limit: int, filters: Filters = Filters()) -> list[dict[str, Any]]:
    """The newest `limit` records (every worker's), oldest first: for /llmproxy/requests and /ui."""
    clause, args = _where(filters)
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        rows = db.execute(f"SELECT data FROM requests {clause} ORDER BY id DESC LIMIT ?", (*args, max(0, limit))).fetchall()
    finally:
        db.close()
    return [orjson.loads(row[0]) for row in reversed(rows)]


def load(path: str, cutoff_ns: int, model: str = "") -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        query = "SELECT data, upstream FROM requests WHERE ended_ns >= ?"
        args: list[Any] = [cutoff_ns]
        if model:
            query += " AND model = ?"
            args.append(model)
        out = []
        for data, upstream in db.execute(query, args):
            record = orjson.loads(data)
            record.setdefault("upstream", upstream)
            out.append(record)
        return out
    finally:
        db.close()
