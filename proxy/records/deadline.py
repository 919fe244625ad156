"""A PostgreSQL connection that cannot hang: made with TCP keepalives, each call under a client-side deadline,
so a peer that vanished without a reset is found in seconds; its errors told without the password.

A primary that fails over behind the same address (a pod IP gone, a partition, a node lost) leaves the
connection open and silent: libpq waits on its socket until the kernel gives up, 15 minutes to 2 hours,
and the writer, the maintenance pass and the readers behind `/ui` wait with it. TCP keepalives and
`tcp_user_timeout` (set on every connection: `OPTIONS`) end that wait when nothing answers at the TCP
level, but a pooler, a sidecar or a cloud SQL proxy in front of the store keeps acknowledging while the
server behind it is gone. So each call also runs under a deadline of its own: past it, the
connection's socket is shut down under the blocked call (a duplicate of its descriptor, so libpq's
stays its own to close), the call fails at once as on a reset, and the caller makes a new connection,
to whatever the address resolves to now.

One watchdog thread serves every deadline of a store (a thread per call would cost a thread's start per
batch and per read).
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import re
import socket
import threading
import time
from typing import Any, Iterator

import psycopg

# libpq's own: keepalives after 5 s idle, every 2 s, 3 missed: a dead peer at the TCP level is found in 11 s; data
# unacknowledged for 10 s ends the connection (tcp_user_timeout, ms).
OPTIONS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3, "tcp_user_timeout": 10_000}


def redact(url: str) -> str:
    """The URL with its password replaced: what log lines and errors may show."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def connect(url: str, password_file: str = "", **options: Any) -> psycopg.Connection[Any]:
    """A connection (autocommit: transactions are explicit); the password file, when given, wins. Nothing prepared: a
    generic plan prunes no partition (the rollup's statement ran 5x slower). No JIT: the server's default compiles any
    statement its planner costs over 100,000, and compiling took 400 of the 460 ms of a day's sums at 10 M records
    (bench store explain-window); a statement of ours runs for milliseconds to a second, never long enough to repay it."""
    options["options"] = f"-c jit=off {options.get('options', '')}".strip()
    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": 5, "application_name": "llm-latency-proxy", "prepare_threshold": None,
                              **OPTIONS, **options}
    if password_file:
        with open(password_file, encoding="utf-8") as handle:
            kwargs["password"] = handle.read().strip()
    return psycopg.connect(url, **kwargs)


def scrubbed(exc: BaseException, url: str) -> str:
    """An error's text with no password in it, whatever the driver echoed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    password = re.search(r"://[^:/@]+:([^@]*)@", url)
    return redact(text.replace(password.group(1), "***") if password and password.group(1) else text)


class Watchdog:
    """A store's deadlines, soonest first, on one daemon thread started at the first."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.due: list[tuple[float, int, Any]] = []  # (when, order, the connection)
        self.order = itertools.count()
        self.cancelled: set[int] = set()
        self.thread: threading.Thread | None = None

    def arm(self, conn: Any, seconds: float) -> int:
        with self.cond:
            token = next(self.order)
            heapq.heappush(self.due, (time.monotonic() + seconds, token, conn))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="llmproxy-store-deadlines", daemon=True)
                self.thread.start()
            self.cond.notify()
            return token

    def disarm(self, token: int) -> None:
        with self.cond:
            self.cancelled.add(token)

    @contextlib.contextmanager
    def deadline(self, conn: Any, seconds: float) -> Iterator[None]:
        """The calls on `conn` inside: cut past `seconds` (then they raise as on a reset: psycopg.OperationalError)."""
        token = self.arm(conn, seconds)
        try:
            yield
        finally:
            self.disarm(token)

    def _run(self) -> None:
        with self.cond:
            while True:
                while self.due and self.due[0][1] in self.cancelled:
                    self.cancelled.discard(heapq.heappop(self.due)[1])
                if not self.due:
                    self.cond.wait()
                    continue
                when, token, conn = self.due[0]
                wait = when - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                heapq.heappop(self.due)
                cut(conn)


def cut(conn: Any) -> None:
    """The connection's socket shut down under whatever waits on it (its descriptor left to libpq to close)."""
    try:
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=os.dup(fd))
    except Exception:  # noqa: BLE001 - closed meanwhile, or no socket yet: nothing waits on it
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
