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

A serving process and its writer processes (outbox.py) keep one row each, so that whoever dies, each record is
counted once. The serving process's row (`Serving`, written by its current writer process): records numbered,
handed over to writer processes (its `written`), dropped by itself; so its loss is what it still held. Each
writer process (a generation: a new one replaces one that died) has a row of its own boot and pid: what was
handed to it (its `assigned`), written, dropped; so its loss is what it held and never wrote. The serving
process knows exactly what it handed a writer process that died and what that one said it dropped
(`Previous`): the next generation settles the dead one's row with those figures, and where a pass counted it
lost already (from its last figures), adds what that count missed.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from .sql import Dialect

STALE_S = 300.0  # a boot elsewhere unseen this long is gone (a replica that cannot reach the store for longer is counted, then corrected)


@dataclass(frozen=True)
class Serving:
    """A serving process's own figures (outbox.py), for its row: numbered, handed to its writer processes, dropped."""

    boot: str
    pid: int
    started_ns: int
    numbered: int
    handed: int
    dropped: int


@dataclass(frozen=True)
class Previous:
    """The writer process before this one, as its serving process saw it die: what it was handed, what it said it dropped."""

    boot: str
    pid: int
    handed: int
    dropped: int


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
    serving: Serving | None = None  # a writer process's serving process (its row is written with this one's)
    previous: Previous | None = None  # the writer process this one replaced, until its row is settled


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


def seen(conn: Any, dialect: Dialect, tally: Tally, now_ns: int) -> int:
    """A pass's figures: this writer's row, its serving process's, and the writer process it replaced settled with
    what its serving process handed it; what that settling found lost beyond a count already made (else 0)."""
    conn.execute(*upsert(dialect, tally, 0, now_ns))
    serving = tally.serving
    if serving is not None:
        conn.execute(*_absolute(dialect, Tally(serving.boot, tally.instance, tally.host, serving.pid, serving.started_ns, serving.numbered,
                                               serving.dropped), serving.handed, now_ns))
    previous = tally.previous
    if previous is None:
        return 0
    row = conn.execute(dialect.sql("SELECT state, lost FROM llmproxy_boots WHERE boot = ?"), (previous.boot,)).fetchone()
    if row is None:  # (it died before its first batch or pass: the next pass counts it)
        conn.execute(*_absolute(dialect, Tally(previous.boot, tally.instance, tally.host, previous.pid, tally.started_ns, previous.handed,
                                               previous.dropped), 0, now_ns))
        return 0
    settled = conn.execute(dialect.sql(
        "UPDATE llmproxy_boots SET assigned = ?, dropped = CASE WHEN dropped > ? THEN dropped ELSE ? END WHERE boot = ? "
        "AND state IN ('running', 'lost') RETURNING assigned - written - dropped"), (previous.handed, previous.dropped, previous.dropped,
                                                                                   previous.boot)).fetchone()
    if row[0] != "lost" or settled is None:
        return 0
    missed = max(0, int(settled[0])) - int(row[1])
    if missed > 0:
        conn.execute(dialect.sql("UPDATE llmproxy_boots SET lost = lost + ? WHERE boot = ?"), (missed, previous.boot))
    return max(0, missed)


def _absolute(dialect: Dialect, tally: Tally, written: int, now_ns: int) -> tuple[str, tuple[Any, ...]]:
    """A row written whole (a serving process's: its `written` is what it handed over; a dead writer's)."""
    statement = ("INSERT INTO llmproxy_boots (boot, instance, host, pid, started_ns, assigned, written, dropped, seen_ns, state) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'running') ON CONFLICT (boot) DO UPDATE SET assigned = excluded.assigned, "
                 "written = excluded.written, dropped = excluded.dropped, seen_ns = excluded.seen_ns "
                 "WHERE llmproxy_boots.state = 'running'")  # (counted lost already: not counted again)
    return dialect.sql(statement), (tally.boot, tally.instance, tally.host, tally.pid, tally.started_ns, tally.assigned, written,
                                    tally.dropped, now_ns)


def close(conn: Any, dialect: Dialect, tally: Tally, now_ns: int, clean: bool = True) -> None:
    """The boot's last figures, its serving process's too: closed (a clean stop), or left running for the next pass to
    account (its serving process killed: what that one held and never handed over is counted too)."""
    seen(conn, dialect, tally, now_ns)
    if clean:
        for boot in (tally.boot, *((tally.serving.boot,) if tally.serving is not None else ())):
            conn.execute(dialect.sql("UPDATE llmproxy_boots SET state = 'closed' WHERE boot = ?"), (boot,))


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
