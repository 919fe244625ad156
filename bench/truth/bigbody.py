"""A 12 MB non-streaming response while 16 streams run: does it stall the other streams?

The simulator and each target run as separate processes on loopback. A round starts 16 streams at
once (TTFT 20 ms, then --tokens tokens at --tps tok/s: a known inter-token gap) and measures every
gap between content chunks at the client. In a "with" round, another process fetches a 12 MB
non-streaming response through the same target every 0.5 s while the streams run. Targets are
interleaved round by round, in one run: `direct` (the simulator itself: the floor, since the
simulator and the clients also handle the 12 MB on the same two cores), this checkout's proxy, and
with --before DIR a proxy run from another checkout (a `git worktree` of an older commit).
Reports medians over the rounds of the gap p50, p99 and largest gap, and the p99 difference.

    .venv/bin/python -m bench.truth bigbody [--rounds 8] [--before DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.harness import Connection, pct, simulator  # noqa: E402

from proxy.processes import free_port, serve_command, started  # noqa: E402

BODY = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def fetch_big(port: int, big_bytes: int, logprobs: bool, seconds: float, every: float, ready: Any, count: Any) -> None:
    """In its own process: a 12 MB response every `every` seconds for `seconds`."""
    async def run() -> None:
        shape = {"x-sim-logprobs": str(big_bytes // 77)} if logprobs else {"x-sim-body-bytes": str(big_bytes)}  # 77 bytes an entry
        conn = Connection("127.0.0.1", port, "/v1", {"x-sim-ttft-ms": "0", **shape})
        ready.set()
        await asyncio.sleep(0.2)  # the streams are decoding
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start, _, status = await conn.complete(BODY)
            assert status == 200, status
            count.value += 1
            await asyncio.sleep(max(0.0, start + every - time.perf_counter()))
        conn.close()
    asyncio.run(run())


async def streams(port: int, n: int, tokens: int, tps: float) -> list[float]:
    body = {**BODY, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    conns = [Connection("127.0.0.1", port, "/v1", {"x-sim-ttft-ms": "20", "x-sim-decode-tps": str(tps)}) for _ in range(n)]
    results = await asyncio.gather(*(c.stream(body) for c in conns))
    for c in conns:
        c.close()
    return [(b - a) * 1000 for _, arrivals, _ in results for a, b in zip(arrivals[1:], arrivals[2:])]


def round_(port: int, args: argparse.Namespace, big: bool) -> tuple[tuple[float, float, float], int]:
    helper, count = None, multiprocessing.get_context("spawn").Value("i", 0)
    if big:
        ready = multiprocessing.get_context("spawn").Event()
        helper = multiprocessing.get_context("spawn").Process(
            target=fetch_big, args=(port, int(args.big_mb * 1e6), args.logprobs, args.tokens / args.tps - 0.2, 0.5, ready, count))
        helper.start()
        ready.wait(30)
    gaps = asyncio.run(streams(port, args.streams, args.tokens, args.tps))
    if helper is not None:
        helper.join(30)
    return (pct(gaps, 0.5), pct(gaps, 0.99), max(gaps)), count.value


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--tps", type=float, default=50.0)
    parser.add_argument("--big-mb", type=float, default=12.0)
    parser.add_argument("--logprobs", action="store_true", help="parse-heavy bodies (logprobs entries) instead of one long string")
    parser.add_argument("--before", default="", help="a checkout whose proxy is measured too (before/after)")
    args = parser.parse_args()
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    sim_port = free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    targets = {"direct": sim_port, "proxy": free_port()}
    if args.before:
        targets["proxy before"] = free_port()
    with contextlib.ExitStack() as stack:
        stack.enter_context(simulator(sim_port))
        for name, port in targets.items():
            if name != "direct":
                src = os.path.abspath(args.before) if name == "proxy before" else here
                stack.enter_context(started([], f"http://127.0.0.1:{port}/healthz", command=serve_command(src, "serve", "--upstream", f"{sim}/v1", "--port", str(port)), quiet=True))
        rows: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
        counts = []
        for port in targets.values():
            round_(port, argparse.Namespace(**{**vars(args), "tokens": 30}), True)  # warm-up
        for _ in range(args.rounds):
            for name, port in targets.items():
                for big in (False, True):
                    figures, count = round_(port, args, big)
                    rows.setdefault((name, big), []).append(figures)
                    if big:
                        counts.append(count)
    print(f"{args.streams} streams at {args.tps:g} tok/s (gap {1000 / args.tps:g} ms), {args.tokens} tokens, {args.rounds} rounds per "
          f"target, interleaved; with: {statistics.median(counts):g} responses of {args.big_mb:g} MB per round (median), "
          f"{'logprobs entries' if args.logprobs else 'one long content string'}")
    print("| target | big responses | gap p50 ms | gap p99 ms | largest gap ms |\n|---|---|---|---|---|")
    med = {key: [statistics.median(row[i] for row in values) for i in range(3)] for key, values in rows.items()}
    for (name, big), (p50, p99, largest) in med.items():
        print(f"| {name} | {'with' if big else 'without'} | {p50:.2f} | {p99:.2f} | {largest:.1f} |")
    print("\n| target | p99 with - without (ms) | largest with - without (ms) |\n|---|---|---|")
    for name in targets:
        print(f"| {name} | {med[(name, True)][1] - med[(name, False)][1]:+.2f} | {med[(name, True)][2] - med[(name, False)][2]:+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
