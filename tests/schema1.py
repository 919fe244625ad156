"""Schema 1 of the records stores, as its replicas create and write it (proxy/records/ at d5554fc, before
the store counted): a store to migrate in place, and an old replica that keeps writing during a rolling
upgrade. Its statements, copied: the contract the new version must honour is these tables and writes."""
from __future__ import annotations

import sqlite3
import time
from typing import Any

import orjson

SQLITE = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY, ended_ns INTEGER NOT NULL, pid INTEGER NOT NULL,
    model TEXT NOT NULL, upstream TEXT NOT NULL, endpoint TEXT NOT NULL, stream INTEGER NOT NULL, outcome TEXT NOT NULL,
    data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS requests_ended ON requests (ended_ns);
CREATE INDEX IF NOT EXISTS requests_model ON requests (model, upstream, ended_ns);
"""
POSTGRES = (
    "CREATE TABLE IF NOT EXISTS llmproxy_meta (key text PRIMARY KEY, value text NOT NULL)",
    """CREATE TABLE IF NOT EXISTS llmproxy_requests (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, rid text NOT NULL, ended_ns bigint NOT NULL,
        instance text NOT NULL, pid integer NOT NULL, model text NOT NULL, upstream text NOT NULL, endpoint text NOT NULL,
        stream boolean NOT NULL, outcome text NOT NULL, api text NOT NULL, slo text, slo_good boolean, data json NOT NULL)""",
    "CREATE UNIQUE INDEX IF NOT EXISTS llmproxy_requests_rid ON llmproxy_requests (rid)",
    "CREATE INDEX IF NOT EXISTS llmproxy_requests_ended ON llmproxy_requests (ended_ns)",
    "CREATE INDEX IF NOT EXISTS llmproxy_requests_model ON llmproxy_requests (model, upstream, ended_ns)",
    "CREATE INDEX IF NOT EXISTS llmproxy_requests_instance ON llmproxy_requests (instance, id)",
)
COLUMNS = ("rid", "ended_ns", "instance", "pid", "model", "upstream", "endpoint", "stream", "outcome", "api", "slo", "slo_good", "data")


def _v1(record: dict[str, Any]) -> dict[str, Any]:
    """A record as schema 1's writers stored it: no `id` in its JSON."""
    return {k: v for k, v in record.items() if k != "id"}


def sqlite_create(path: str) -> None:
    db = sqlite3.connect(path)
    with db:
        db.executescript(SQLITE)
        db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', '1')")
    db.close()


def sqlite_write(path: str, records: list[dict[str, Any]]) -> None:
    """What a schema 1 worker's batch did (its migrate first: it refuses a newer schema_version)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        assert version is not None and int(version[0]) <= 1, "a schema 1 writer would refuse this file"
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO requests (ended_ns, pid, model, upstream, endpoint, stream, outcome, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                           [(time.time_ns(), 1, r["model"], r["upstream"], r["endpoint"], int(r["stream"]), r["outcome"], orjson.dumps(_v1(r)))
                            for r in records])
    finally:
        db.close()


def postgres_create(conn: Any) -> None:
    with conn.transaction():
        for statement in POSTGRES:
            conn.execute(statement)
        conn.execute("INSERT INTO llmproxy_meta (key, value) VALUES ('schema_version', '1') ON CONFLICT (key) DO NOTHING")


def postgres_write(conn: Any, records: list[dict[str, Any]]) -> None:
    """What a schema 1 replica's batch did: it checks schema_version (refusing a newer one), then
    inserts, a batch written twice stored once (ON CONFLICT (rid))."""
    version = conn.execute("SELECT value FROM llmproxy_meta WHERE key = 'schema_version'").fetchone()
    assert version is not None and int(version[0]) <= 1, "a schema 1 replica would refuse this store"
    with conn.transaction():
        conn.cursor().executemany(
            f"INSERT INTO llmproxy_requests ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))}) ON CONFLICT (rid) DO NOTHING",
            [(r["id"], time.time_ns(), r["instance"], 1, r["model"], r["upstream"], r["endpoint"], r["stream"], r["outcome"], r["api"],
              r.get("slo"), r.get("slo_good"), orjson.dumps(_v1(r)).decode()) for r in records])
