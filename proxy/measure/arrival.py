"""When bytes reached a socket, from the kernel: a stamp the proxy's own scheduling cannot move.

Under a CPU quota (a Kubernetes limit), a noisy neighbour, a GC pause or a burst, the event loop runs
late, and bytes wait in the socket's buffer until it gets to them. A stamp taken when the loop reads
them would put the proxy's own delay into the engine's phases (queue, prefill, decode) and into the
network. The kernel notes when the last data segment arrived on a TCP socket: `tcpi_last_data_recv`
of TCP_INFO, the milliseconds since then, kept in jiffies (resolution: the kernel's tick, 4 ms at
HZ=250, 1 ms at HZ=1000). Why not SO_TIMESTAMPNS: it is exact, but its stamp rides on `recvmsg`, and
uvloop's transports read with `recv`, which drops it; TCP_INFO is one `getsockopt` on the same socket
(about 0.4 µs a read here, on a socket object of our own: `socket_of`; bench/RESULTS.md).

The estimate is the latest instant the arrival can have been, never later than the loop's own stamp:
- 0 ms: the segment arrived in this tick, and the loop's stamp stands (a prompt loop: exact);
- n ticks ago: it arrived within the tick that began n ticks before the current one: that tick's end.
When did the current tick begin? CLOCK_MONOTONIC_COARSE (the same clock as `time.monotonic_ns`) steps once a
tick, but its value is the kernel's timekeeping grid, which is not the tick's: here it reads 0.9 ms behind the
moment it steps, jiffies with it (a CI run stamped reads 0.8 ms before their bytes were written, taking the
coarse value as the tick's start). The phase is steady without NTP and drifts with NTP's frequency steering
(µs a second), so `TickPhase` measures it in its own thread every 10 s: polling every 50 µs across a few steps,
the fine clock less the coarse one at the first poll after each step (never below the phase), the median.
Until measured, the next coarse value stands for the tick's start: one tick after its value, never before it.
A read just after the kernel woke from idle can see the coarse value of a tick whose jiffies step is still to
come (timekeeping catches up to the latest grid point, jiffies to the latest tick): one tick fewer counted,
so the stamp is a tick later than it might be, never earlier. So a late read is stamped within a tick after
its bytes arrived, two after a wake from idle (the phase's margin aside), and never before they did.

What no stamp can show: bytes that arrived in several segments while the loop was away are one read,
stamped with the last segment's arrival (the kernel also merges queued segments, with the newest
stamp). timing.split() reads a run of equal stamps as one such read.
"""
from __future__ import annotations

import socket
import statistics
import struct
import threading
import time
from typing import Any

_COARSE = getattr(time, "CLOCK_MONOTONIC_COARSE", 6)  # (Linux's clock id: Python names it only on some builds)
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_RECV = 52  # struct tcp_info: 8 bytes of u8 fields, then u32s; tcpi_last_data_recv (ms) is the 12th
_RTT = 68  # ... tcpi_rtt (µs) the 16th
try:
    TICK_NS = round(time.clock_getres(_COARSE) * 1e9) if _TCP_INFO is not None else 0
except OSError:  # (not Linux: no coarse clock, no TCP_INFO)
    TICK_NS = 0
_HALF_TICK_NS = TICK_NS // 2
_IPPROTO_TCP = socket.IPPROTO_TCP
_UNPACK = struct.Struct("=I").unpack_from
# The tick's start less the coarse clock's value: one per machine, so one per process, set by TickPhase (a tick:
# not measured yet, the safe side). A list, so the thread's store is seen by compiled readers.
PHASE_NS = [TICK_NS]
PHASE_MARGIN_NS = 100_000  # a tick's interrupt later than the median one: stamps err late by this, not early
_STEPS = 5  # coarse steps a measurement polls across
_POLL_S = 50e-6


def socket_of(transport: Any) -> socket.socket | None:
    """A socket object on a transport's descriptor, for `arrived_ns`, kept for the connection's life and given back with
    `let_go` (it never closes the descriptor: the transport does). uvloop's own stand-in makes a socket object and asks
    the kernel for its address at each call (three system calls and an object per read, where this is one call)."""
    raw = transport.get_extra_info("socket")
    if raw is None or not TICK_NS:
        return None
    try:
        return socket.socket(raw.family, raw.type, raw.proto, raw.fileno())
    except (OSError, AttributeError, ValueError):
        return None


def let_go(sock: socket.socket | None) -> None:
    """The descriptor is the transport's: detached, never closed here."""
    if sock is not None:
        sock.detach()


def arrived_ns(sock: Any, now: int) -> int:
    """When the last bytes read from `sock` (a TCP socket, or uvloop's stand-in for one) reached it, `now`
    being the loop's stamp of the read; `now` where the kernel cannot say."""
    if not TICK_NS or sock is None:
        return now
    try:
        info: bytes = sock.getsockopt(_IPPROTO_TCP, _TCP_INFO, 56)
    except (OSError, AttributeError, TypeError):  # (not TCP: a Unix socket, a closed one)
        return now
    if len(info) < 56:
        return now
    ms: int = _UNPACK(info, _LAST_DATA_RECV)[0]
    if ms == 0:
        return now
    ticks = (ms * 1_000_000 + _HALF_TICK_NS) // TICK_NS
    latest: int = time.clock_gettime_ns(_COARSE) + PHASE_NS[0] - (ticks - 1) * TICK_NS
    return latest if latest < now else now


class TickPhase:
    """Measures PHASE_NS in a daemon thread: a few coarse steps every `every_s`, each caught by polling every 50 µs
    from just before it is due: 0.3 ms of CPU and 20 ms of wall time a measurement here, 30 µs of CPU a second."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None

    def measure(self) -> int | None:
        """The median, over _STEPS coarse steps, of the fine clock less the new coarse value at the first poll
        after the step; None when the kernel keeps no coarse ticks or a step never came in time."""
        if not TICK_NS:
            return None
        seen: list[int] = []
        guess = PHASE_NS[0] if PHASE_NS[0] < TICK_NS else 0
        for _ in range(_STEPS):
            start = time.clock_gettime_ns(_COARSE)
            wait_s = (start + TICK_NS + guess - 200_000 - time.monotonic_ns()) / 1e9
            if wait_s > 0:
                time.sleep(wait_s)
            give_up = time.monotonic_ns() + 3 * TICK_NS
            while (coarse := time.clock_gettime_ns(_COARSE)) == start:
                if time.monotonic_ns() > give_up:
                    return None
                time.sleep(_POLL_S)
            seen.append(time.monotonic_ns() - coarse)
        return int(statistics.median(seen))

    def calibrate(self) -> None:
        phase = self.measure()
        if phase is not None and phase < TICK_NS:
            PHASE_NS[0] = phase + PHASE_MARGIN_NS

    def start(self) -> None:
        if TICK_NS and self._worker is None:
            self._worker = threading.Thread(target=self._run, name="llmproxy-tick-phase", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            self.calibrate()
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()


def socket_rtt_s(sock: Any) -> float | None:
    """The kernel's smoothed RTT of a TCP socket (TCP_INFO's tcpi_rtt), in seconds; None where it cannot say. Of a
    socket just connected, its first sample: the SYN to the SYN-ACK (a SYN sent again is not sampled: 0)."""
    if _TCP_INFO is None or sock is None:
        return None
    try:
        info: bytes = sock.getsockopt(_IPPROTO_TCP, _TCP_INFO, 72)
    except (OSError, AttributeError, TypeError):
        return None
    return _UNPACK(info, _RTT)[0] / 1e6 if len(info) >= 72 else None
