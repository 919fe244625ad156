"""The fleet store's schema and its versions (PostgreSQL), and moving a live store to this one: online,
so that the fleet's old replicas keep writing and no write waits over a second.

Two versions in `llmproxy_meta`: `store_level`, what the schema is (`LEVEL`), and `store_version`, the
oldest writer version it still takes (what every proxy checks: one refuses a store whose
`store_version` is above its own, and keeps its records buffered, saying so). Each level only adds
(columns with no default or a constant one, tables, indexes), so old writers' statements, which name
their columns, still work: `store_version` stays at `WRITERS_FROM`, the version whose writers run no
DDL of their own on this schema.

How a level is reached without stopping anyone (PostgreSQL's own guidance):
- catalog steps (ADD COLUMN, CREATE TABLE), each in a short transaction of its own with `lock_timeout`
  (`LOCK_TIMEOUT_MS`): waiting for its lock behind a long reader, it would queue every writer behind it,
  so it gives up and tries again after a pause (jittered) instead; made by the replica that opens the
  store first (an advisory lock), before it writes, in milliseconds;
- indexes: built on each partition CONCURRENTLY (writes go on), outside any transaction and with no
  statement timeout, then attached to the parent's index (made ON ONLY: invalid until every partition's
  is attached, when PostgreSQL makes it valid); an interrupted build leaves an invalid index, dropped
  and built again; by one replica's maintenance thread (never its writer), in the background;
- `store_level` is raised only when every step and index is there.
"""
from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from . import columns as C
from . import sql as A
from .partitions import HIST, HIST_BLOCK, ROLLUP, TABLE

log = logging.getLogger("llmproxy.records")

LEVEL = 6  # 6: phase lag (the proxy's own delay behind bytes that had arrived); 5: model_name (a record's own model where the aggregates fold it); 4: llmproxy_boots (crash accounting);
# 3: tenant, end user, phase failover; 2: typed columns, aggregates
WRITERS_FROM = 3  # written as store_version: what a version-3 proxy sees as its own (it runs no migration then)
MIGRATE_LOCK, INDEX_LOCK = 0x6C6D7001, 0x6C6D7005  # advisory locks ("lm" p n; 2-4: postgres.py, partitions.py)
LOCK_TIMEOUT_MS = 200  # a catalog step's wait for its lock: every writer queued behind it waits at most this
STEP_TRIES = 50  # ... tried again this many times (pauses of 0.1-0.5 s)
TYPES: dict[str, str] = {**{c: "float8" for c in C.REALS}, **{c: "integer" for c in C.INTEGERS}, **{c: "text" for c in (*C.DIMENSIONS, *C.TEXTS, "rid")},
                         **{c: "bigint" for c in ("key", "ended_ns", "received_ns", "series")}}


@dataclass(frozen=True)
class Index:
    name: str  # the parent's; each partition's is `{partition}_{suffix}`
    suffix: str
    columns: str  # "(tenant, ended_ns)", with its INCLUDE or WHERE

    def on_parent(self) -> str:
        return f"CREATE INDEX IF NOT EXISTS {self.name} ON ONLY {TABLE} {self.columns}"


# Each level's catalog steps and its indexes (what a store one level below lacks).
V3_INDEXES = (Index(f"{TABLE}_tenant", "tenant", "(tenant, ended_ns)"),  # a quiet tenant's or a user's newest
              Index(f"{TABLE}_user", "user", "(user_id, ended_ns) WHERE user_id IS NOT NULL"))
BOOTS = ("CREATE TABLE IF NOT EXISTS llmproxy_boots (boot text PRIMARY KEY, instance text NOT NULL, host text NOT NULL, "
         "pid integer NOT NULL, started_ns bigint NOT NULL, assigned bigint NOT NULL, written bigint NOT NULL, dropped bigint NOT NULL, "
         "seen_ns bigint NOT NULL, state text NOT NULL, lost bigint NOT NULL DEFAULT 0)")
STEPS: dict[int, tuple[tuple[str, ...], tuple[Index, ...]]] = {
    2: ((f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS tenant text, ADD COLUMN IF NOT EXISTS user_id text, ADD COLUMN IF NOT EXISTS ph_failover float8",
         f"ALTER TABLE {ROLLUP} ADD COLUMN IF NOT EXISTS tenant text NOT NULL DEFAULT 'unknown', "
         + ", ".join(f"ADD COLUMN IF NOT EXISTS {name} {'float8' if name.endswith(A.FLOATS) else 'bigint'}" for name in A.V3_SUMS)),
        V3_INDEXES),
    3: ((BOOTS,), ()),
    4: ((f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS model_name text",), ()),
    5: ((f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS ph_lag float8",
         f"ALTER TABLE {ROLLUP} " + ", ".join(f"ADD COLUMN IF NOT EXISTS {name} float8" for name in A.V6_SUMS)), ()),
}
SCHEMA = (
    # The records: the typed columns (columns.py: rid, key, the end time that is the partition key, the
    # dimensions, the figures' values, the fits' points, the blamed phases) and the record, compressed.
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
    *(f"CREATE INDEX IF NOT EXISTS {i.name} ON {TABLE} {i.columns}" for i in V3_INDEXES),  # (an empty table: at once)
    # The aggregates (sql.py), each keyed by the start of its block or hour (ns), partitioned by day.
    f"""CREATE TABLE IF NOT EXISTS {ROLLUP} (start bigint NOT NULL, series bigint NOT NULL,
        {', '.join(f'{name} text NOT NULL' for name in C.DIMENSIONS)},
        {', '.join(f"{name} {'float8' if name.endswith(A.FLOATS) else 'bigint'}" for name, _, _ in A.SUMS)},
        PRIMARY KEY (start, series)) PARTITION BY RANGE (start)""",
    *(statement for table in (HIST, HIST_BLOCK) for statement in (
        f"""CREATE TABLE IF NOT EXISTS {table} (start bigint NOT NULL, {', '.join(f'{d} text NOT NULL' for d in A.HIST_DIMS)},
            code integer NOT NULL, bucket integer NOT NULL, n bigint NOT NULL) PARTITION BY RANGE (start)""",
        f"CREATE INDEX IF NOT EXISTS {table}_start ON {table} (start)")),
    "CREATE TABLE IF NOT EXISTS llmproxy_compacted (span bigint NOT NULL, start bigint NOT NULL, at_ns bigint NOT NULL, PRIMARY KEY (span, start))",
    "CREATE TABLE IF NOT EXISTS llmproxy_dirty (span bigint NOT NULL, start bigint NOT NULL, PRIMARY KEY (span, start))",
    BOOTS,
)


class Newer(Exception):
    """The store takes writers of a newer version only."""


def _meta(conn: psycopg.Connection[Any], key: str) -> int | None:
    row = conn.execute("SELECT value FROM llmproxy_meta WHERE key = %s", (key,)).fetchone()
    return int(row[0]) if row else None


def level(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(the store's level, the oldest writer version it takes); (0, 0) for an empty store."""
    if conn.execute("SELECT to_regclass('llmproxy_meta')").fetchone()[0] is None:  # type: ignore[index]
        return 0, 0
    floor = _meta(conn, "store_version") or 0
    return _meta(conn, "store_level") or floor, floor


def _step(conn: psycopg.Connection[Any], statement: str) -> None:
    """One catalog statement in its own short transaction, never waiting long for its lock (tried again)."""
    for attempt in range(STEP_TRIES):
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}")
                conn.execute(statement)
            return
        except psycopg.errors.LockNotAvailable:
            if attempt == STEP_TRIES - 1:
                raise
            time.sleep(random.uniform(0.1, 0.5))


def _done(conn: psycopg.Connection[Any], statement: str) -> bool:
    """Whether a catalog step is already there: every column an ALTER adds, or the table a CREATE makes."""
    created = re.match(r"CREATE TABLE IF NOT EXISTS (\w+)", statement)
    if created:
        return conn.execute("SELECT to_regclass(%s)", (created.group(1),)).fetchone()[0] is not None  # type: ignore[index]
    altered = re.match(r"ALTER TABLE (\w+) ", statement)
    added = re.findall(r"ADD COLUMN IF NOT EXISTS (\w+)", statement)
    if not altered or not added:
        return False
    have = {row[0] for row in conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = %s",
                                           (altered.group(1),)).fetchall()}
    return set(added) <= have


def _set(conn: psycopg.Connection[Any], key: str, value: int) -> None:
    conn.execute("INSERT INTO llmproxy_meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                 (key, str(value)))


def prepare(conn: psycopg.Connection[Any]) -> bool:
    """What a writer needs before it writes (autocommit connection): the schema made, or an older one's catalog
    steps taken; Newer if the store takes newer writers only. True: at this level already (no index to build)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))  # (replicas starting together: one at a time, briefly)
        conn.execute("CREATE TABLE IF NOT EXISTS llmproxy_meta (key text PRIMARY KEY, value text NOT NULL)")
        current, floor = level(conn)
        if floor > LEVEL:
            raise Newer(f"the records store takes writers of version {floor} or newer and this proxy writes version {LEVEL}: upgrade this "
                        "replica (its records wait in its buffer meanwhile, the oldest dropped past it, counted)")
        if current >= LEVEL:
            return True
        if conn.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is None:  # type: ignore[index]
            for statement in SCHEMA:  # (a new store, or schema 1's beside it: empty tables, every index at once)
                conn.execute(statement)
            _set(conn, "store_level", LEVEL)
            _set(conn, "store_version", max(floor, WRITERS_FROM))
            return True
    for at in range(current, LEVEL):
        for statement in STEPS[at][0]:
            if not _done(conn, statement):  # (read in the catalog first: an ALTER takes ACCESS EXCLUSIVE even when it adds nothing)
                _step(conn, statement)
    log.warning("the records store is at level %d and this proxy writes level %d: the new columns and tables are there; the new "
                "indexes are built in the background (CONCURRENTLY, partition by partition), then its level is raised", current, LEVEL)
    return False


def finish(conn: psycopg.Connection[Any]) -> bool:
    """In the maintenance thread (autocommit connection): every index this level adds built, then the level
    raised; one replica at a time. True when the store is at this level (or another replica is at it)."""
    current, floor = level(conn)
    if current >= LEVEL:
        return True
    if not conn.execute("SELECT pg_try_advisory_lock(%s)", (INDEX_LOCK,)).fetchone()[0]:  # type: ignore[index]
        return False
    try:
        conn.execute("SET statement_timeout = 0")  # (a build takes as long as its partition)
        for at in range(current, LEVEL):
            for statement in STEPS[at][0]:
                _step(conn, statement)
            for index in STEPS[at][1]:
                build(conn, index)
        _set(conn, "store_level", LEVEL)
        _set(conn, "store_version", max(floor, WRITERS_FROM))
        log.warning("the records store is at level %d now (its indexes built online)", LEVEL)
        return True
    finally:
        conn.execute("RESET statement_timeout")
        conn.execute("SELECT pg_advisory_unlock(%s)", (INDEX_LOCK,))


def build(conn: psycopg.Connection[Any], index: Index) -> None:
    """The parent's index ON ONLY, then each partition's CONCURRENTLY and attached (PostgreSQL then marks the
    parent's valid). Partitions attached meanwhile got theirs from the attach; an invalid one (an interrupted
    build) is dropped and built again."""
    _step(conn, index.on_parent())
    while True:
        missing = conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass "
            "AND NOT EXISTS (SELECT 1 FROM pg_inherits x JOIN pg_index p ON p.indexrelid = x.inhrelid "
            "WHERE x.inhparent = %s::regclass AND p.indrelid = c.oid)", (TABLE, index.name)).fetchall()
        if not missing:
            return
        for (partition,) in missing:
            name = f"{partition}_{index.suffix}"
            valid = conn.execute("SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)", (name,)).fetchone()
            if valid is not None and not valid[0]:
                conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
                valid = None
            if valid is None:
                conn.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {partition} {index.columns}")
            _step(conn, f"ALTER INDEX {index.name} ATTACH PARTITION {name}")
