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
- n ticks ago: it arrived within the tick that began n ticks before the current one (whose start is
  CLOCK_MONOTONIC_COARSE, the same clock as `time.monotonic_ns`, kept at the tick): that tick's end.
So a late read is stamped at most one tick after its bytes arrived, and never before they did.

What no stamp can show: bytes that arrived in several segments while the loop was away are one read,
stamped with the last segment's arrival (the kernel also merges queued segments, with the newest
stamp). timing.split() reads a run of equal stamps as one such read.
"""
from __future__ import annotations

import socket
import struct
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
    latest: int = time.clock_gettime_ns(_COARSE) - (ticks - 1) * TICK_NS
    return latest if latest < now else now


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
