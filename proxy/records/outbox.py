"""The serving process's side of its records writer, which runs in a process of its own.

Why a process: what a record costs beyond its JSON (its typed columns, its compression, the store's
driver encoding the batch, SQLite's own inserting and indexing in-process) held the serving process's
GIL and CPU: 65 µs a record, 13% fewer short requests a second (bench/store/records_cost.py). Here the
serving process only names the record, serialises it once (orjson) and queues it; what is queued goes to
the writer process over a pipe, one message a batch, where a `Writer`
(records/__init__.py: its bounded buffer, batches, retries, maintenance, boots) does the rest, and reports back
what the metrics count (written, dropped by reason, errors, records lost by crashes, what it buffers). Reads
(`recent`, the summaries) go to the store directly, from this process.

When: once `HOLD_RECORDS` are queued (at most one message per `SEND_S` under load), or once the oldest has
waited `HOLD_S`. Each message wakes the writer process, and at a coding agent's pace (a request every 150 ms)
a message a record cost more CPU than the rest of the record's way to the store: 0.51 against 0.23 ms a request
in the writer process (bench/RESULTS.md). What a record waits for is bounded by both: a kill -9 finds at most
`HOLD_RECORDS` (or `SEND_S` of them, under load) not handed over, and counts them (below).

Who sends: on the event loop (the finisher adds records there), the loop itself, with a write that never
waits (`MSG_DONTWAIT`), at once or on a timer. A sender thread woken for
each message cost more than the record (on this VM a thread's wake-up is 70-160 µs of CPU, against a
few for the write). The sender thread does the rest: what a full pipe would block on (the loop hands it the
message, the part not written first), flushes and the close (from other threads), records added off the loop,
and a dead writer process replaced. One lock keeps their messages whole on the pipe.

A kill -9 of the serving process ends the pipe: the writer process writes what it holds (within
`ORPHAN_S`) and leaves its boot running with its last figures, so that the next maintenance pass anywhere
counts what the crash lost (boots.py). The records it never handed over are counted too: each is numbered,
in memory both processes share (`assigned`), when it is made. The writer process dying is noticed by the
sender: a new one is started, and what the dead one held is counted by its boot.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import mmap
import multiprocessing
import os
import signal
import socket
import struct
import threading
import time
from multiprocessing import reduction
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from . import Filters, Row, Writer, open_backend, serialise
from .columns import ended_ns

log = logging.getLogger("llmproxy.records")

SEND_S = 0.01  # under load, at most one message per SEND_S
HOLD_S = 1.0  # the longest a record waits in the serving process
HOLD_RECORDS = 64  # a message goes once this many are queued (or the oldest waited HOLD_S)
FLUSH_S = 2.0  # a flush waits this long at most
ORPHAN_S = 5.0  # what the writer process may take to write what it holds once the serving process is gone


class Count:
    """How far the serving process has numbered its records, in 8 bytes both processes map (a memfd's page): written
    by the serving process for each record, read by its writer process for its boot's figures. The memfd's own
    descriptor is closed once a writer process has it (`handed`), so the mapping's is the only one the serving
    process keeps: as many as the fork server it replaced (its descriptors are what `--max-connections` is sized
    from, admission.py). Each writer process started gets a fresh memfd holding the number so far."""

    __slots__ = ("_fd", "_view")

    def __init__(self) -> None:
        self._fd = -1
        self._view: memoryview | None = None

    @property
    def value(self) -> int:
        view = self._view
        return int(view[0]) if view is not None else 0

    def set(self, value: int) -> None:
        view = self._view
        if view is not None:
            view[0] = value

    def open(self) -> None:
        """A fresh memfd holding the number so far, for a writer process about to start. (The old mapping is only let
        go of: the loop may be writing to it this instant, from another thread.)"""
        value, fd = self.value, os.memfd_create("llmproxy-records-assigned")
        os.ftruncate(fd, 8)
        view = memoryview(mmap.mmap(fd, 8)).cast("q")
        view[0] = value
        self.handed()
        self._fd, self._view = fd, view

    def handed(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        return _attached, (reduction.DupFd(self._fd),)  # (its descriptor, passed to the process being started)


def _attached(holder: Any) -> Count:
    """In the writer process: the serving process's count, mapped."""
    fd = holder.detach()
    count = Count()
    count._view = memoryview(mmap.mmap(fd, 8)).cast("q")
    os.close(fd)
    return count


def _serve(conn: Any, target: str, options: dict[str, Any], instance: str, boot: str, limits: tuple[int, int], assigned: Count) -> None:
    """The writer process: rows from the pipe into a Writer; what it counts back up the pipe. A signal to the whole
    process group (Ctrl-C, systemd's KillMode=control-group, `tini -g`) is the serving process's to act on: this one
    ignores it, and ends when the serving process closes it (or is gone: ORPHAN_S), its buffer written."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(5)  # (below the serving process: its relay first)
    except OSError:
        pass
    lock = threading.Lock()

    def report(*message: Any) -> None:
        with lock:
            try:
                conn.send(message)
            except (OSError, ValueError):
                pass  # (the serving process is gone: what it would have counted, its boot counts)

    writer = Writer(open_backend(target, **options), instance, limits[0], limits[1], lambda: report("error"),
                    lambda reason, n: report("drop", reason, n), lambda stored, waiting: report("batch", stored, waiting),
                    on_lost=lambda n: report("lost", n), boot=boot, assigned=lambda: assigned.value,
                    on_nulled=lambda field, n: report("nulled", field, n))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the serving process died (kill -9): write what there is, leave the boot running
            writer.close(ORPHAN_S, clean=False)
            return
        kind = message[0]
        if kind == "rows":
            for rid, ended, data, seq in message[1]:
                writer.put(Row(rid, ended, data, seq))
        elif kind == "flush":
            writer.flush(message[2])
            report("flushed", message[1])
        elif kind == "close":
            writer.close(message[1])
            report("closed")
            return


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
                 on_lost: Callable[[int], None] | None = None, on_nulled: Callable[[str, int], None] | None = None) -> None:
        self.backend = open_backend(target, **options)  # (reads only, from this process)
        self.where = self.backend.where
        self.target, self.options, self.instance, self.limits = target, options, instance, (max_records, max_bytes)
        self.on_error, self.on_drop, self.on_batch, self.on_lost, self.on_nulled = on_error, on_drop, on_batch, on_lost, on_nulled
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
        # How far this process has numbered its records, in shared memory: what its writer process writes as its boot's
        # `assigned`, so that records a kill -9 finds queued here are counted (boots.py).
        self._assigned = Count()
        self._rest = b""  # a message the loop began to write and the sender thread finishes
        self._socket: socket.socket | None = None  # the pipe's socket, for the loop's writes
        self._start()
        self._sender = threading.Thread(target=self._send, name="llmproxy-records-send", daemon=True)
        self._sender.start()

    def _start(self) -> None:
        if self._socket is not None:
            self._socket.close()  # (the dead writer process's)
        # A fresh interpreter (spawn): no thread of this process copied, and this process's path. (A fork server, before,
        # took neither the path nor the temporary folder away: it imported whatever `proxy` its working directory held, and
        # each proxy stopped by SIGTERM left its listener's folder in /tmp.)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=_serve, args=(child, self.target, self.options, self.instance, self.boot, self.limits,
                                                             self._assigned),
                                        name="llmproxy-records", daemon=True)  # (not joined at exit; a kill -9 of this one leaves it to finish)
        self._assigned.open()
        self._process.start()
        self._assigned.handed()
        child.close()
        self._socket = socket.socket(fileno=os.dup(self._conn.fileno()))  # (the loop's writes: MSG_DONTWAIT, the fd stays blocking)
        self._receiver = threading.Thread(target=self._receive, args=(self._conn,), name="llmproxy-records-receive", daemon=True)
        self._receiver.start()

    def add(self, record: dict[str, Any]) -> None:
        """The only call on the request side: name the record (its stable `id`), serialise it, queue it."""
        seq = next(self._seq)
        record["id"] = rid = f"{self.instance}/{self.boot}/{seq}"
        try:
            item = (rid, ended_ns(record), serialise(record), seq)
        except (TypeError, ValueError, KeyError):
            self.on_error()
            self.on_drop("rejected", 1)
            return
        queue = self._queue
        queue.append(item)
        self._assigned.set(seq)
        if len(queue) > self.limits[0]:  # (a writer process that stopped reading: the oldest go, counted, as in its own buffer)
            queue.popleft()
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
            rows = _drained(self._queue)
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
            if sent < len(message):
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
                rest, self._rest = self._rest, b""
                rows, flushes = _drained(self._queue), _drained(self._to_send)
                self._last = time.monotonic()
                try:
                    if rest:
                        assert self._socket is not None
                        self._socket.sendall(rest)  # (the loop's message, finished first: its rows came before these)
                    if rows:
                        self._conn.send(("rows", rows))
                    for token in flushes:
                        self._conn.send(("flush", token, FLUSH_S))
                    if stopping:
                        self._conn.send(("close", self._close_s))
                        return
                except (OSError, ValueError):
                    if stopping:
                        return
                    self.on_error()
                    log.error("the records writer process died: another is started (what it held is counted by its boot's figures)")
                    self._start()
                    if rows:
                        self._conn.send(("rows", rows))

    def _receive(self, conn: Any) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "batch":
                self.buffered = message[2]
                if self.on_batch is not None:
                    self.on_batch(message[1], message[2])
            elif kind == "drop":
                self.on_drop(message[1], message[2])
            elif kind == "error":
                self.on_error()
            elif kind == "lost" and self.on_lost is not None:
                self.on_lost(message[1])
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
