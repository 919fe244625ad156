"""Records a crash lost, counted: each writer's boot in the store (`llmproxy_boots`), both stores.

A writer numbers its records in order (`seq`, in each record's id: instance/boot/seq). With every batch
it writes, in the same transaction, how far it has numbered (`assigned`), how many of its records the
store took (`written`) and how many it dropped and counted itself (`dropped`: a full buffer, a refused
record, the shutdown deadline); its maintenance pass does the same every few seconds while it is idle
(`seen_ns`, the store's clock). A clean stop marks its boot `closed`. A boot still `running` whose writer
is gone (on this host: its process no longer there; elsewhere: not seen for `STALE_S`) lost what it had
numbered and never wrote nor counted: `assigned - written - dropped`, the records it held when it was
killed. The first writer (or `explain`, a reader) to see it marks it `lost` with that count, once (the
UPDATE is conditional), and `llmproxy_records_lost_total` counts it. A serving process's records count as
numbered when they are made, before they are handed to its writer process (outbox.py), so a kill -9 of that
process counts those it still held. Records numbered after the last batch or pass of a writer killed too
(under a second's worth) are beyond what the store can know.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from .sql import Dialect

STALE_S = 300.0  # a boot elsewhere unseen this long is gone (a replica that cannot reach the store for longer is counted, then corrected)


@dataclass(frozen=True)
class Tally:
    """A writer's own figures, as it hands them to the store."""

    boot: str
    instance: str
    host: str
    pid: int
    started_ns: int
    assigned: int
    dropped: int


def host() -> str:
    return socket.gethostname()


def upsert(dialect: Dialect, tally: Tally, written: int, now_ns: int) -> tuple[str, tuple[Any, ...]]:
    """The boot's row, its figures moved on (in a batch's transaction: `written` is the batch's new records)."""
    statement = ("INSERT INTO llmproxy_boots (boot, instance, host, pid, started_ns, assigned, written, dropped, seen_ns, state) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'running') ON CONFLICT (boot) DO UPDATE SET assigned = excluded.assigned, "
                 "written = llmproxy_boots.written + excluded.written, dropped = excluded.dropped, seen_ns = excluded.seen_ns, "
                 "state = 'running', lost = 0")  # (a boot counted lost that writes again was only unreachable: corrected)
    return dialect.sql(statement), (tally.boot, tally.instance, tally.host, tally.pid, tally.started_ns, tally.assigned, written,
                                    tally.dropped, now_ns)


def close(dialect: Dialect, tally: Tally, now_ns: int, clean: bool = True) -> tuple[str, tuple[Any, ...]]:
    """The boot's last figures: closed (a clean stop), or left running for the next pass to account (its serving
    process killed: what was numbered and never handed over is then counted too)."""
    if not clean:
        return dialect.sql("UPDATE llmproxy_boots SET assigned = ?, dropped = ?, seen_ns = ? WHERE boot = ? AND state = 'running'"), \
            (tally.assigned, tally.dropped, now_ns, tally.boot)
    return dialect.sql("UPDATE llmproxy_boots SET assigned = ?, dropped = ?, seen_ns = ?, state = 'closed' WHERE boot = ?"), \
        (tally.assigned, tally.dropped, now_ns, tally.boot)


def _alive(pid: int) -> bool:
    """A process of this host still running (a zombie no one reaped is not: its writer is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # (no /proc: the signal said it is there)


def account(conn: Any, dialect: Dialect, now_ns: int, mine: str = "") -> int:
    """Every running boot whose writer is gone marked lost with what it lost (once, whoever gets there first);
    their sum."""
    here = host()
    gone = [boot for boot, where, pid, seen in conn.execute(dialect.sql(
        "SELECT boot, host, pid, seen_ns FROM llmproxy_boots WHERE state = 'running' AND boot <> ?"), (mine,)).fetchall()
            if (where == here and (pid == os.getpid() or not _alive(pid))) or now_ns - seen > STALE_S * 1e9]
    lost = 0
    for boot in gone:
        row = conn.execute(dialect.sql("UPDATE llmproxy_boots SET state = 'lost', lost = CASE WHEN assigned - written - dropped > 0 "
                                       "THEN assigned - written - dropped ELSE 0 END WHERE boot = ? AND state = 'running' RETURNING lost"),
                           (boot,)).fetchone()
        lost += int(row[0]) if row else 0
    return lost


def lost_since(conn: Any, dialect: Dialect, start_ns: int) -> int:
    """Records lost in crashes of writers that started after `start_ns` (explain's window)."""
    row = conn.execute(dialect.sql("SELECT coalesce(sum(lost), 0) FROM llmproxy_boots WHERE state = 'lost' AND seen_ns >= ?"),
                       (start_ns,)).fetchone()
    return int(row[0]) if row else 0
