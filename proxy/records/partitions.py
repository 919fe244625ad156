"""PostgreSQL's day partitions of the records and their aggregates (`llmproxy_records_YYYYMMDD`, …):
made `DAYS_AHEAD` days ahead and for any day a batch brings (an import's history), each as a plain
table then ATTACHed, which takes SHARE UPDATE EXCLUSIVE on the parent, so writers and readers never
wait for it (CREATE TABLE … PARTITION OF would take ACCESS EXCLUSIVE); dropped whole when all of a
day is older than the age limit, or while the newer days hold the row cap (the planner's counts):
DETACH … CONCURRENTLY, then DROP. No DELETE, no bloat. A drop interrupted half way is finished at
the next pass: a detach pending, or a table detached and not dropped (no longer a partition: found
by its name and the mark the drop put on it first; a day table detached by hand has none, and stays). Every day is by the store's clock (`now_ns`), never a replica's.
"""
from __future__ import annotations

import datetime
import re
from typing import Any, Iterable

import psycopg

from . import columns as C
from .sql import BLOCK_NS, BLOCKS_KEPT_S

TABLE, ROLLUP, HIST, HIST_BLOCK = "llmproxy_records", "llmproxy_rollup", "llmproxy_hist", "llmproxy_hist_block"
PARENTS = (TABLE, ROLLUP, HIST, HIST_BLOCK)  # each by the end time of a record, or the start of a block or hour (ns)
PARTITION_LOCK = 0x6C6D7003  # advisory lock ("lm" p 3): one replica makes a day's partitions
DROP_LOCK = 0x6C6D7006  # ("lm" p 6): one replica drops expired days (outside the retention lock: drop_all)
DETACH_WAIT_S = 30.0  # how long a detach may wait for the transactions that might see its day (lock_timeout)
DAYS_AHEAD = 2
DROPPING = "llmproxy: expired, being dropped"  # the comment on a day table whose drop began (orphans)
EPOCH = datetime.date(1970, 1, 1)


def _day(name: str) -> int | None:
    """The day (since the epoch) a partition's name holds."""
    match = re.search(r"_(\d{8})$", name)
    if not match:
        return None
    return (datetime.datetime.strptime(match.group(1), "%Y%m%d").date() - EPOCH).days


def _partition(parent: str, day: int) -> tuple[str, int, int]:
    """(name, from, to) of a parent's partition for one day."""
    return f"{parent}_{(EPOCH + datetime.timedelta(days=day)).strftime('%Y%m%d')}", day * C.DAY_NS, (day + 1) * C.DAY_NS


class Partitions:
    """The days whose partitions exist (as this connection has seen them), and the drops."""

    def __init__(self) -> None:
        self.days: set[int] = set()

    def ahead(self, conn: psycopg.Connection[Any], now_ns: int) -> None:
        today = now_ns // C.DAY_NS
        self.ensure(conn, range(today, today + DAYS_AHEAD + 1))

    def ensure(self, conn: psycopg.Connection[Any], days: Iterable[int]) -> None:
        """Every table's partition for these days: made whole, then attached (writers never wait)."""
        for day in sorted(set(days) - self.days):
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (PARTITION_LOCK,))
                for parent in PARENTS:
                    name, low, high = _partition(parent, day)
                    if conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()[0] is None:  # type: ignore[index]
                        fill = "" if parent == TABLE else " WITH (fillfactor = 70)"  # (the aggregates' rows are updated in place)
                        conn.execute(f"CREATE TABLE {name} (LIKE {parent} INCLUDING DEFAULTS){fill}")
                        conn.execute(f"ALTER TABLE {parent} ATTACH PARTITION {name} FOR VALUES FROM ({low}) TO ({high})")
            self.days.add(day)

    @staticmethod
    def _partitions(conn: psycopg.Connection[Any], parent: str) -> list[tuple[int, str, float, bool]]:
        """(day, name, estimated rows (-1: never counted), detach pending) of a parent's partitions, oldest first."""
        rows = conn.execute("SELECT c.relname, c.reltuples, i.inhdetachpending FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                            "WHERE i.inhparent = %s::regclass", (parent,)).fetchall()
        return sorted((day, name, tuples, pending) for name, tuples, pending in rows if (day := _day(name)) is not None)

    def expired(self, conn: psycopg.Connection[Any], max_age_s: float, max_rows: int, now_ns: int) -> list[str]:
        """The partitions to drop: past the age limit (a whole day older than it), then the oldest days
        while the newer ones hold --records-max-rows; and any a drop left half done."""
        out: list[str] = []
        cutoff_day = (now_ns - int(max_age_s * 1e9)) // C.DAY_NS if max_age_s > 0 else None  # days before it are past
        records = self._partitions(conn, TABLE)
        days = {day for parent in PARENTS for day, _, _, _ in self._partitions(conn, parent)}  # (a day whose records a drop took first too)
        gone: set[int] = {day for day in days if cutoff_day is not None and day < cutoff_day}
        if max_rows > 0 and any(rows < 0 for _, _, rows, _ in records):  # (never counted yet: a sample now)
            for _, name, rows, _ in records:
                if rows < 0:
                    conn.execute(f"ANALYZE {name}")
            records = self._partitions(conn, TABLE)
        if max_rows > 0:
            kept = [r for r in records if r[0] not in gone]
            total = sum(max(0.0, rows) for _, _, rows, _ in kept)
            for day, _, rows, _ in kept[:-1]:  # (never the newest)
                if total - rows < max_rows:
                    break
                gone.add(day)
                total -= max(0.0, rows)
        for parent in PARENTS:
            out += [name for day, name, _, pending in self._partitions(conn, parent) if day in gone or pending]
        blocks_kept = (now_ns - int(BLOCKS_KEPT_S * 1e9)) // C.DAY_NS  # (the ten-minute histograms: for a window's first hour)
        out += [name for day, name, _, _ in self._partitions(conn, HIST_BLOCK) if day < blocks_kept and name not in out]
        return out + [name for name in self.orphans(conn) if name not in out]

    @staticmethod
    def orphans(conn: psycopg.Connection[Any]) -> list[str]:
        """Day tables of ours that are no partition and that a drop marked (`DROPPING`) before its detach: that drop,
        interrupted, finished. A day table detached by hand (an archive) carries no mark and is never touched."""
        pattern = "^(" + "|".join(PARENTS) + r")_[0-9]{8}$"
        return [name for (name,) in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
            "AND n.nspname = current_schema() AND c.relname ~ %s AND NOT c.relispartition AND obj_description(c.oid, 'pg_class') = %s",
            (pattern, DROPPING)).fetchall()]

    def oldest(self, conn: psycopg.Connection[Any]) -> int:
        """Where the oldest day of records begins (ns): anything counted before it is gone."""
        days = self._partitions(conn, TABLE)
        return days[0][0] * C.DAY_NS if days else 0

    def drop_all(self, conn: psycopg.Connection[Any], names: list[str]) -> None:
        """Expired days dropped outside the retention lock: DETACH … CONCURRENTLY waits for every transaction that might
        see its day (a long reader's), and compaction must not wait with it. One replica at a time, each wait at most
        DETACH_WAIT_S: past it the pass fails (counted, step retention) and a later one finishes the detach."""
        if not names or not conn.execute("SELECT pg_try_advisory_lock(%s)", (DROP_LOCK,)).fetchone()[0]:  # type: ignore[index]
            return
        try:
            conn.execute(f"SET lock_timeout = {int(DETACH_WAIT_S * 1000)}")
            for name in names:
                self.drop(conn, name)
            for table in ("llmproxy_compacted", "llmproxy_dirty"):  # (what the dropped days' aggregates were)
                conn.execute(f"DELETE FROM {table} WHERE start < %s", (self.oldest(conn),))
        finally:
            conn.execute("RESET lock_timeout")
            conn.execute("SELECT pg_advisory_unlock(%s)", (DROP_LOCK,))

    def drop(self, conn: psycopg.Connection[Any], name: str) -> None:
        """Detached (CONCURRENTLY: readers and writers never wait), then dropped; what a kept block's histograms said
        goes with its day (`llmproxy_compacted`)."""
        parent = name.rsplit("_", 1)[0]  # (its name: the parent's, _YYYYMMDD)
        if parent == HIST_BLOCK and (day := _day(name)) is not None:
            conn.execute(f"DELETE FROM llmproxy_compacted WHERE span = {BLOCK_NS} AND start >= %s AND start < %s",
                         (day * C.DAY_NS, (day + 1) * C.DAY_NS))
        pending = conn.execute("SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%s)", (name,)).fetchone()
        if pending is not None:
            conn.execute(f"COMMENT ON TABLE {name} IS '{DROPPING}'")  # (expired: the mark that lets a later pass finish the drop)
            conn.execute(f"ALTER TABLE {parent} DETACH PARTITION {name} {'FINALIZE' if pending[0] else 'CONCURRENTLY'}")
        conn.execute(f"DROP TABLE IF EXISTS {name}")
        self.days.discard(_day(name) or -1)
