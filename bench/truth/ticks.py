"""How true is the kernel's arrival stamp (proxy/measure/arrival.py) against the write, per estimate of the tick's start?

    .venv/bin/python -m bench.truth ticks --reads 400

A real loopback TCP pair: bytes written, then read 0-13 ms later (random: every phase of the kernel's tick),
and each read that the kernel's path stamps (a tick or more late) is held to its write. Three estimates of
when the current tick began, on the same reads: the coarse clock's value (the code before: its value runs
behind its step), the next coarse value (before the phase is measured), and the value plus the measured phase
(`TickPhase`). A stamp before the write is a lie; one after it is the tick's resolution.
"""
from __future__ import annotations

import argparse
import random
import socket
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from proxy.measure import arrival  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=400)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    tick = arrival.TICK_NS
    if not tick:
        raise SystemExit("no TCP_INFO or coarse clock here")
    phase = arrival.TickPhase().measure()
    assert phase is not None
    print(f"tick {tick / 1e6:.1f} ms; the coarse value runs {phase / 1e3:.0f} µs behind its step (median of 5)")
    listener = socket.create_server(("127.0.0.1", 0))
    writer = socket.create_connection(listener.getsockname())
    reader, _ = listener.accept()
    rng = random.Random(args.seed)
    offsets = {"coarse value (before)": 0, "next coarse value (unmeasured)": tick, "value + phase + margin": phase + arrival.PHASE_MARGIN_NS}
    errors: dict[str, list[int]] = {name: [] for name in offsets}
    for _ in range(args.reads):
        before = time.monotonic_ns()
        writer.send(b"x" * 64)
        time.sleep(rng.uniform(0, 0.013))
        now = time.monotonic_ns()
        reader.recv(4096)
        ms = struct.unpack_from("=I", reader.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 56), 52)[0]
        coarse = time.clock_gettime_ns(6)
        if ms == 0:
            continue
        ticks = (ms * 1_000_000 + tick // 2) // tick
        for name, offset in offsets.items():
            errors[name].append(min(now, coarse + offset - (ticks - 1) * tick) - before)
    print(f"{len(errors['coarse value (before)'])} reads a tick or more late; stamp − write, µs:")
    print("| tick's start | before the write | min | p50 | p99 | max |\n|---|---|---|---|---|---|")
    for name, values in errors.items():
        v = sorted(values)
        print(f"| {name} | {sum(x < 0 for x in v)} | {v[0] / 1e3:.0f} | {v[len(v) // 2] / 1e3:.0f} | {v[int(len(v) * 0.99)] / 1e3:.0f} | {v[-1] / 1e3:.0f} |")


if __name__ == "__main__":
    main()
