"""A 12 MB non-streaming response while 16 streams run: does it stall the other streams?

Simulator and proxy run as separate processes on loopback. Each round starts 16 streams at once
(TTFT 20 ms, then --tokens tokens at --tps tok/s, so a known inter-token gap) and measures every
gap between content chunks at the client. Rounds alternate: without, then with big non-streaming
responses fetched back to back through the same proxy during the streams. Reports the gap p50/p99
of each kind and the p99 difference (with - without), medians over the rounds.

    .venv/bin/python bench/bigbody.py [--rounds 5] [--proxy-src DIR]

--proxy-src runs the proxy from another checkout (e.g. a `git worktree` of an older commit), for a
before/after comparison on the same simulator.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from proxy.demo import free_port, started  # noqa: E402
from rawclient import Connection  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def round_(port: int, streams: int, tokens: int, tps: float, big_bytes: int, big: bool) -> tuple[list[float], int]:
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"x-sim-ttft-ms": "20", "x-sim-decode-tps": str(tps)}
    conns = [Connection("127.0.0.1", port, "/v1", headers) for _ in range(streams)]
    done = asyncio.Event()

    async def bigs() -> int:
        count = 0
        conn = Connection("127.0.0.1", port, "/v1", {"x-sim-ttft-ms": "0", "x-sim-body-bytes": str(big_bytes)})
        await asyncio.sleep(0.2)  # the streams are decoding
        while not done.is_set():
            _, _, status = await conn.complete({"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert status == 200, status
            count += 1
        conn.close()
        return count

    task = asyncio.create_task(bigs()) if big else None
    results = await asyncio.gather(*(c.stream(body) for c in conns))
    done.set()
    count = await task if task is not None else 0
    for c in conns:
        c.close()
    gaps = [(b - a) * 1000 for _, arrivals, _ in results for a, b in zip(arrivals[1:], arrivals[2:])]
    return gaps, count


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--tps", type=float, default=50.0)
    parser.add_argument("--big-mb", type=float, default=12.0)
    parser.add_argument("--proxy-src", default=os.path.join(os.path.dirname(__file__), ".."))
    args = parser.parse_args()
    sim_port, proxy_port = free_port(), free_port()
    sim, proxy = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
    env = {"PYTHONPATH": os.path.abspath(args.proxy_src)}
    serve = [sys.executable, "-m", "proxy", "serve", "--upstream", f"{sim}/v1", "--port", str(proxy_port)]
    with started(["simulate", "--port", str(sim_port)], f"{sim}/health", quiet=True), \
         started([], f"{proxy}/healthz", env=env, command=serve, quiet=True):
        rows: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
        counts = []
        asyncio.run(round_(proxy_port, args.streams, 20, args.tps, int(args.big_mb * 1e6), True))  # warm-up (the worker)
        for _ in range(args.rounds):
            for kind in ("without", "with"):
                gaps, count = asyncio.run(round_(proxy_port, args.streams, args.tokens, args.tps, int(args.big_mb * 1e6), kind == "with"))
                rows[kind].append((pct(gaps, 0.5), pct(gaps, 0.99)))
                if kind == "with":
                    counts.append(count)
    med = {k: (statistics.median(p50 for p50, _ in v), statistics.median(p99 for _, p99 in v)) for k, v in rows.items()}
    print(f"proxy from {os.path.abspath(args.proxy_src)}; {args.streams} streams at {args.tps:g} tok/s (gap {1000 / args.tps:g} ms), "
          f"{args.rounds} rounds; with: {statistics.median(counts):g} responses of {args.big_mb:g} MB per round (median)")
    print("| run | gap p50 ms | gap p99 ms |\n|---|---|---|")
    for kind, (p50, p99) in med.items():
        print(f"| {kind} big responses | {p50:.2f} | {p99:.2f} |")
    print(f"| p99 difference (with - without) | | {med['with'][1] - med['without'][1]:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
