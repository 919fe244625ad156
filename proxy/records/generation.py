"""A records writer process (a generation: a new one replaces one that died, outbox.py), and what it shares with
its serving process.

`serve` is its life: rows from the pipe into a `Writer`, what it counts back up the pipe. `Counts` is what the
serving process has done with its records, in memory the writer process maps (boots.py): three figures, 8 bytes
each, in a memfd's page: records numbered (set for each record made), handed to writer processes (moved on as each
message goes into the pipe) and dropped by the serving process itself (its queue full, a record it could not
serialise). The writer process reads them for the serving process's row and its own,
and after a kill -9 of the serving process still can: the figures outlive it.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import signal
import threading
from multiprocessing import reduction
from typing import Any

from . import Row, Writer, open_backend
from .boots import Previous, Serving

NUMBERED, HANDED, DROPPED = 0, 1, 2
ORPHAN_S = 5.0  # what the writer process may take to write what it holds once the serving process is gone


class Counts:
    """The figures, written by the serving process (one writer thread at a time for each: the loop numbers, the wire's
    lock guards handing), read by its writer process. The memfd's own descriptor is closed once a writer process has
    it (`handed_over`), so the mapping's is the only one the serving process keeps: as many as the fork server it
    replaced (its descriptors are what `--max-connections` is sized from, admission.py). Each writer process started
    gets a fresh memfd holding the figures so far."""

    __slots__ = ("_fd", "_lock", "_view")

    def __init__(self) -> None:
        self._fd = -1
        self._view: memoryview | None = None
        self._lock = threading.Lock()  # a change and the copy into a new mapping (`open`), one at a time: none lost between

    def get(self, slot: int) -> int:
        view = self._view
        return int(view[slot]) if view is not None else 0

    def set(self, slot: int, value: int) -> None:
        lock = self._lock
        lock.acquire()  # (not `with`: twice the cost, and this is once a record)
        try:
            view = self._view
            if view is not None:
                view[slot] = value
        finally:
            lock.release()

    def add(self, slot: int, value: int) -> None:
        lock = self._lock
        lock.acquire()
        try:
            view = self._view
            if view is not None:
                view[slot] += value
        finally:
            lock.release()

    def open(self) -> None:
        """A fresh memfd holding the figures so far, for a writer process about to start. (The old mapping is only let
        go of, never closed: a reader may hold it this instant. A change made while the memfd is made, by the loop or the
        wire's thread, lands before the copy or after the swap: the lock.)"""
        fd = os.memfd_create("llmproxy-records-counts")
        os.ftruncate(fd, 24)
        view = memoryview(mmap.mmap(fd, 24)).cast("q")
        with self._lock:
            view[0], view[1], view[2] = (self.get(slot) for slot in (NUMBERED, HANDED, DROPPED))
            self.handed_over()
            self._fd, self._view = fd, view

    def handed_over(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        return _attached, (reduction.DupFd(self._fd),)  # (its descriptor, passed to the process being started)


def _attached(holder: Any) -> Counts:
    """In the writer process: the serving process's figures, mapped."""
    fd = holder.detach()
    counts = Counts()
    counts._view = memoryview(mmap.mmap(fd, 24)).cast("q")
    os.close(fd)
    return counts


def serve(conn: Any, target: str, options: dict[str, Any], instance: str, boot: str, limits: tuple[int, int], counts: Counts,
           base: int, serving: tuple[str, int, int], previous: Previous | None) -> None:
    """The writer process: rows from the pipe into a Writer; what it counts back up the pipe. A signal to the whole
    process group (Ctrl-C, systemd's KillMode=control-group, `tini -g`) is the serving process's to act on: this one
    ignores it, and ends when the serving process closes it (or is gone: ORPHAN_S), its buffer written."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(5)  # (below the serving process: its relay first)
        ctypes.CDLL(None).prctl(15, b"llmproxy-writer", 0, 0, 0)  # PR_SET_NAME: what ps, top and an OOM kill's log say
    except (OSError, AttributeError):
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
                    on_lost=lambda n: report("lost", n), boot=boot, assigned=lambda: counts.get(HANDED) - base,
                    on_nulled=lambda field, n: report("nulled", field, n), previous=previous,
                    serving=lambda: Serving(*serving, counts.get(NUMBERED), counts.get(HANDED), counts.get(DROPPED)),
                    on_maintenance=lambda step: report("maintenance", step))
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
