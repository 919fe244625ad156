"""The serving process's side of its records writer, which runs in a process of its own.

Why a process: what a record costs beyond its JSON (typed columns, compression, the driver encoding the batch,
SQLite's inserting in-process) held the serving process's GIL and CPU: 65 µs a record, 13% fewer short requests a
second (bench/store/records_cost.py). Here the serving process names the record, serialises it once (orjson) and
queues it; the queue goes to the writer process over a pipe, where a `Writer` (records/__init__.py: its bounded
buffer, batches, retries, maintenance, boots) does the rest and reports back what the metrics count. Reads
(`recent`, the summaries) go to the store directly, from this process. The queue is bounded in records and in
bytes (the buffer's caps: the oldest go, counted) and goes in messages of at most `MESSAGE_BYTES`.

When: once `HOLD_RECORDS` are queued (at most one message per `SEND_S` under load), or once the oldest has
waited `HOLD_S`. Each message wakes the writer process, and at a coding agent's pace (a request every 150 ms)
a message a record cost more CPU than the rest of the record's way to the store: 0.51 against 0.23 ms a request
in the writer process (bench/RESULTS.md). A kill -9 finds at most `HOLD_RECORDS` (or `SEND_S` of them, under
load) not handed over, and counts them (below).

Who sends: on the event loop (the finisher adds records there), the loop itself, with a write that never waits
(`MSG_DONTWAIT`), at once or on a timer: a sender thread woken for each message cost more than the record (a
thread's wake-up is 70-160 µs of CPU here). The sender thread does the rest: what a full pipe would block on, more
than a message, flushes and the close, records added off the loop, and a dead writer process replaced (as soon as
its pipe ends; never once shutdown began). One lock keeps their messages whole on the pipe.

Whoever dies, each record is counted once (boots.py): this process's figures (numbered, handed over, dropped) are
in memory its writer process maps (generation.Counts) and writes to this process's row; each writer process has a row of
its own. A kill -9 of this process ends the pipe: the writer process writes what it holds (within
generation.ORPHAN_S) and leaves both rows running with their last figures, for the next pass anywhere to count.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import os
import socket
import struct
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from . import Filters, open_backend, serialise
from .boots import Previous
from .generation import DROPPED, HANDED, NUMBERED, Counts, serve
from .columns import ended_ns

log = logging.getLogger("llmproxy.records")

SEND_S = 0.01  # under load, at most one message per SEND_S
HOLD_S = 1.0  # the longest a record waits in the serving process
HOLD_RECORDS = 64  # a message goes once this many are queued (or the oldest waited HOLD_S)
FLUSH_S = 2.0  # a flush waits this long at most
MESSAGE_BYTES = 1 << 20  # a message to the writer process holds at most this much (and one record): its pickle, its copy


def _drained(queue: collections.deque[Any]) -> list[Any]:
    """What a deque holds, taken oldest first (popleft: safe beside another thread's append)."""
    items = []
    while queue:
        items.append(queue.popleft())
    return items


class Outbox:
    """What the app holds as its records store: `add` on the request side (the finisher), `flush`,
    `recent` and `backend` for the readers, `close` at shutdown."""

    def __init__(self, target: str, options: dict[str, Any], instance: str, max_records: int, max_bytes: int, on_error: Callable[[], None],
                 on_drop: Callable[[str, int], None], on_batch: Callable[[int, int], None] | None = None,
                 on_lost: Callable[[int], None] | None = None, on_nulled: Callable[[str, int], None] | None = None,
                 on_maintenance: Callable[[str], None] | None = None) -> None:
        self.backend = open_backend(target, **options)  # (reads only, from this process)
        self.where = self.backend.where
        self.target, self.options, self.instance, self.limits = target, options, instance, (max_records, max_bytes)
        self.on_error, self.on_drop, self.on_batch, self.on_lost, self.on_nulled = on_error, on_drop, on_batch, on_lost, on_nulled
        self.on_maintenance = on_maintenance
        self.boot = f"{os.getpid()}/{time.time_ns()}"
        self._seq = itertools.count(1)
        self._queue: collections.deque[tuple[str, int, bytes, int]] = collections.deque()
        self._cond = threading.Condition()
        self._wake = threading.Event()  # set when the queue was empty and is not, or a flush or the close asks
        self._waiting: dict[int, threading.Event] = {}  # flushes not answered yet
        self._to_send: collections.deque[int] = collections.deque()  # flushes to send after the rows before them
        self._tokens = itertools.count(1)
        self._stopping = False
        self._close_s = 5.0
        self._closed = threading.Event()
        self.buffered = 0
        self._wire = threading.Lock()  # held for each message written to the pipe: the loop's and the thread's
        self._last = 0.0  # when the last message went (monotonic)
        self._timer: asyncio.TimerHandle | None = None  # the loop's send at the end of the window
        self._due = 0.0  # when it is due (monotonic)
        self._since = 0.0  # when the oldest record queued was added (monotonic)
        self._urgent = False  # the loop handed what is queued to the sender thread: due now
        # What this process numbered, handed over and dropped, in shared memory: its writer process writes them to this
        # process's row and its own, so that whoever a kill -9 finds holding records, they are counted once (boots.py).
        self._counts = Counts()
        self.started_ns = time.time_ns()
        self._generation = 0  # writer processes started (each has a row of its own: boot.N)
        self._writer_boot = ""
        self._base = 0  # records handed over before the current one started
        self._told_dropped = 0  # records the current one said it dropped
        self._process: Any = None
        self._dead = False  # the writer process's pipe ended (its receiver saw it): the sender thread replaces it
        # What the queue holds in bytes, from three counts each moved by one side only: added (add), taken into messages
        # (under the wire's lock) and dropped past a cap (add).
        self._added_bytes = self._taken_bytes = self._dropped_bytes = 0
        self._rest = b""  # a message the loop began to write and the sender thread finishes
        self._socket: socket.socket | None = None  # the pipe's socket, for the loop's writes
        self._start()
        self._sender = threading.Thread(target=self._send, name="llmproxy-records-send", daemon=True)
        self._sender.start()

    def _start(self) -> None:
        previous = None
        if self._process is not None:  # (the dead writer process's figures, as this process knows them: its row settled)
            previous = Previous(self._writer_boot, self._process.pid or 0, self._counts.get(HANDED) - self._base, self._told_dropped)
        self._generation += 1
        self._writer_boot = f"{self.boot}.{self._generation}"  # (its row's name)
        self._base, self._told_dropped = self._counts.get(HANDED), 0
        if self._socket is not None:
            self._socket.close()  # (the dead writer process's)
        # A fresh interpreter (spawn): no thread of this process copied, and this process's path. (A fork server, before,
        # took neither the path nor the temporary folder away: it imported whatever `proxy` its working directory held, and
        # each proxy stopped by SIGTERM left its listener's folder in /tmp.)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=serve, args=(child, self.target, self.options, self.instance, self._writer_boot,
                                                             self.limits, self._counts, self._base, (self.boot, os.getpid(), self.started_ns),
                                                             previous),
                                        name="llmproxy-records", daemon=True)  # (not joined at exit; a kill -9 of this one leaves it to finish)
        self._counts.open()
        self._process.start()
        self._counts.handed_over()
        child.close()
        self._socket = socket.socket(fileno=os.dup(self._conn.fileno()))  # (the loop's writes: MSG_DONTWAIT, the fd stays blocking)
        self._receiver = threading.Thread(target=self._receive, args=(self._conn,), name="llmproxy-records-receive", daemon=True)
        self._receiver.start()

    def add(self, record: dict[str, Any]) -> None:
        """The only call on the request side: name the record (its stable `id`), serialise it, queue it."""
        seq = next(self._seq)
        record["id"] = rid = f"{self.instance}/{self.boot}/{seq}"
        self._counts.set(NUMBERED, seq)
        try:
            item = (rid, ended_ns(record), serialise(record), seq)
        except (TypeError, ValueError, KeyError):
            self._counts.add(DROPPED, 1)
            self.on_error()
            self.on_drop("rejected", 1)
            return
        queue = self._queue
        queue.append(item)
        self._added_bytes += len(item[2])
        # (a writer process that stopped reading: the oldest go past either cap, counted, as in its own buffer)
        while len(queue) > self.limits[0] or (len(queue) > 1 and self._added_bytes - self._taken_bytes - self._dropped_bytes > self.limits[1]):
            try:
                self._dropped_bytes += len(queue.popleft()[2])
            except IndexError:
                break
            self._counts.add(DROPPED, 1)
            self.on_drop("buffer_full", 1)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        now, queued = time.monotonic(), len(queue)
        if queued == 1:
            self._since = now
        if loop is not None:
            due, timer = self._due_at(queued), self._timer
            if timer is not None and (due < self._due or now > self._due + 1.0):  # (due sooner now; or the timer of a loop gone)
                timer.cancel()
                timer = self._timer = None
            if timer is None:
                if due > now:
                    self._timer, self._due = loop.call_later(due - now, self._send_now), due
                else:
                    self._send_now()
        elif queued == 1 or queued == HOLD_RECORDS:  # (once per batch, not per record; a drain that took it already is harmless)
            self._wake.set()
            if queued == HOLD_RECORDS:
                with self._cond:
                    self._cond.notify_all()  # (the sender thread holds the batch: it is due now)

    def _due_at(self, queued: int) -> float:
        """When what is queued goes (monotonic): HOLD_RECORDS of them at the next SEND_S window, fewer once the oldest
        waited HOLD_S."""
        window = self._last + SEND_S
        return window if queued >= HOLD_RECORDS else max(window, self._since + HOLD_S)

    def _take(self) -> list[Any]:
        """What is queued, oldest first, up to MESSAGE_BYTES (and one record past): one message's rows."""
        rows, size, queue = [], 0, self._queue
        while queue and size < MESSAGE_BYTES:
            try:
                row = queue.popleft()
            except IndexError:  # (add() dropped the oldest meanwhile)
                break
            rows.append(row)
            size += len(row[2])
        self._taken_bytes += size
        return rows

    def _send_now(self) -> None:
        """On the loop: what is queued, as one message, written without waiting. What the pipe does not take
        at once (it is full: the writer process is behind) goes to the sender thread, which waits for it;
        so does everything while the thread is writing."""
        self._timer = None
        if not self._queue:
            return  # (the thread took them)
        if not self._wire.acquire(blocking=False):
            self._wake.set()  # (the thread is writing: it takes these next)
            return
        handed = False
        try:
            if self._rest or self._stopping:  # (the thread finishes a message first, or closes: it takes these)
                handed = True
                return
            rows = self._take()
            payload = ForkingPickler.dumps(("rows", rows))
            message = struct.pack("!i", len(payload)) + payload  # (multiprocessing's framing: the writer process's recv)
            try:
                assert self._socket is not None
                sent = self._socket.send(message, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:  # the writer process is gone: the thread starts another and sends these there
                self._queue.extendleft(reversed(rows))
                handed = True
                return
            self._last = time.monotonic()
            self._counts.add(HANDED, len(rows))  # (in the pipe, whole or in part: the rest goes to the same process or dies with it)
            if sent < len(message) or self._queue:  # (the rest of it, or more than a message: the thread's)
                self._rest = message[sent:]
                handed = True
        finally:
            self._wire.release()
            if handed:
                self._urgent = True
                self._wake.set()

    def _send(self) -> None:
        """The sender thread (the loop sends its own records: `_send_now`). What is queued, in one message, when it is
        due (`_due_at`); what the loop handed over, a flush or the close at once. Asleep while nothing is queued: a
        thread that woke every `SEND_S` regardless cost an idle proxy 8 ms of CPU a second and took the GIL from the
        relay 100 times a second. A dead writer process is replaced."""
        while True:
            self._wake.wait()
            with self._cond:
                if not (self._stopping or self._to_send or self._urgent or self._rest):
                    left = self._due_at(len(self._queue)) - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)  # (the batch's wait; a flush, the close or a full batch cuts it short)
                self._urgent = False
                stopping = self._stopping
            self._wake.clear()  # (before the queue is drained: a record added from here on sets it again, or is drained now)
            with self._wire:
                if self._dead and not stopping:
                    self._replace()
                rest, self._rest = self._rest, b""
                rows: list[Any] = []
                flushes = _drained(self._to_send)
                self._last = time.monotonic()
                try:
                    if rest:
                        assert self._socket is not None
                        self._socket.sendall(rest)  # (the loop's message, finished first: its rows came before these)
                    while rows := self._take():  # (in messages of MESSAGE_BYTES)
                        self._conn.send(("rows", rows))
                        self._counts.add(HANDED, len(rows))
                    for token in flushes:
                        self._conn.send(("flush", token, FLUSH_S))
                    if stopping:
                        self._conn.send(("close", self._close_s))
                        return
                except (OSError, ValueError):
                    if stopping:
                        return
                    self._replace()
                    if rows:
                        self._conn.send(("rows", rows))
                        self._counts.add(HANDED, len(rows))
                    if self._queue:
                        self._urgent = True
                        self._wake.set()

    def _replace(self) -> None:
        """A writer process that died, replaced (under the wire's lock); what it held is counted by its row (boots.py)."""
        self.on_error()
        log.error("the records writer process died (exit code %s): another is started; what it held is counted lost, once",
                  self._process.exitcode if self._process is not None else None)
        self._start()
        self._dead = False  # (after the new pipe is in place: the old one's receiver may have said so meanwhile)

    def _receive(self, conn: Any) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the writer process is gone: replaced at once, not at the next record
                if conn is self._conn and not self._stopping:
                    self._dead = self._urgent = True
                    self._wake.set()
                return
            kind = message[0]
            if kind == "batch":
                self.buffered = message[2]
                if self.on_batch is not None:
                    self.on_batch(message[1], message[2])
            elif kind == "drop":
                if conn is self._conn:
                    self._told_dropped += message[2]
                self.on_drop(message[1], message[2])
            elif kind == "error":
                self.on_error()
            elif kind == "lost" and self.on_lost is not None:
                self.on_lost(message[1])
            elif kind == "maintenance" and self.on_maintenance is not None:
                self.on_maintenance(message[1])
            elif kind == "nulled" and self.on_nulled is not None:
                self.on_nulled(message[1], message[2])
            elif kind == "flushed":
                event = self._waiting.pop(message[1], None)
                if event is not None:
                    event.set()
            elif kind == "closed":
                self._closed.set()
                return

    def flush(self, timeout: float = FLUSH_S) -> None:
        """Until every record added so far is written (or dropped, or the store is unreachable), for at most `timeout`."""
        token, event = next(self._tokens), threading.Event()
        self._waiting[token] = event
        self._to_send.append(token)
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        event.wait(timeout)
        self._waiting.pop(token, None)

    def recent(self, limit: int, filters: Filters) -> list[bytes]:
        return self.backend.recent(limit, filters)

    def close(self, timeout: float = 5.0) -> None:
        """What is queued and buffered written within `timeout` (the rest dropped and counted), the writer process stopped."""
        self._close_s = timeout
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wake.set()
        self._sender.join(timeout + 1.0)
        self._closed.wait(timeout + 2.0)
        self._process.join(5.0)
        if self._process.is_alive():
            self._process.kill()
        if self._socket is not None:
            self._socket.close()
