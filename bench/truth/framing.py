"""A steady stream beside an endless SSE event: does one hostile upstream stall the others?

The simulator sends one data line that never ends (`x-sim-endless-event-bytes`, 1 MB more every
20 ms) to one client, while another client streams a steady schedule (TTFT 20 ms, then 200 tokens
at 50 tok/s: a 20 ms grid) through the same proxy. Arms, interleaved over `--rounds`: the steady
stream alone, and beside the endless event; with `--before DIR`, the same two arms for the proxy
from another checkout (a git worktree of an older commit) in the same run. Figures: the steady
stream's inter-chunk gap p50/p99/max at the client, the bytes the endless client received, and the
proxy's resident memory (peak VmHWM and at the end, from /proc) against --max-event-bytes.

    .venv/bin/python -m bench.truth framing [--rounds 3] [--before /tmp/before]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import checkouts, memory_mb, pct, simulator  # noqa: E402

from proxy.processes import free_port, serve_command, started  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEADY = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True,
          "stream_options": {"include_usage": True}}
STEADY_HEADERS = {"x-sim-ttft-ms": "20", "x-sim-decode-tps": "50"}
ENDLESS_HEADERS = {"x-sim-endless-event-bytes": str(1024 * 1024), "x-sim-endless-every-ms": "20"}


async def steady(client: httpx.AsyncClient, url: str) -> list[float]:
    arrivals: list[float] = []
    async with client.stream("POST", url, json=STEADY, headers=STEADY_HEADERS) as response:
        async for part in response.aiter_raw():
            if b'"content":" ' in part:
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


async def endless(client: httpx.AsyncClient, url: str, stop: asyncio.Event, received: list[int]) -> None:
    async with client.stream("POST", url, json={**STEADY, "max_tokens": 1}, headers=ENDLESS_HEADERS) as response:
        async for part in response.aiter_raw():
            received[0] += len(part)
            if stop.is_set():
                return


async def arm(url: str, hostile: bool) -> tuple[list[float], int]:
    async with httpx.AsyncClient(timeout=60) as client:
        stop, received = asyncio.Event(), [0]
        task = asyncio.create_task(endless(client, url, stop, received)) if hostile else None
        await asyncio.sleep(0.5 if hostile else 0.0)  # the endless event is well under way first
        gaps = await steady(client, url)
        stop.set()
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        return gaps, received[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default="", help="also run the proxy from this checkout, side by side")
    parser.add_argument("--max-event-bytes", type=int, default=16 * 1024 * 1024)
    args = parser.parse_args()
    sim_port = free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    sources = checkouts(args.before)
    results: dict[tuple[str, bool], list[tuple[list[float], int]]] = {}
    memory: dict[str, float] = {}
    baseline: dict[str, float] = {}
    with simulator(sim_port):
        for name, src in sources.items():
            port = free_port()
            flags = ["serve", "--upstream", f"{sim}/v1", "--port", str(port), "--records-db", ""]
            if name == "this proxy":
                flags += ["--max-event-bytes", str(args.max_event_bytes)]
            with started([], f"http://127.0.0.1:{port}/healthz", command=serve_command(src, *flags), quiet=True) as process:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                asyncio.run(arm(url, False))  # warm-up
                baseline[name] = memory_mb(process.pid)
                for _ in range(args.rounds):
                    for hostile in (False, True):
                        results.setdefault((name, hostile), []).append(asyncio.run(arm(url, hostile)))
                memory[name] = memory_mb(process.pid, "VmHWM")
    print(f"steady stream: 200 tokens on a 20 ms grid; endless event: +1 MB every 20 ms; {args.rounds} interleaved rounds; "
          f"--max-event-bytes {args.max_event_bytes:,}")
    print("| proxy | beside an endless event | gap p50 ms | gap p99 ms | gap max ms | endless bytes relayed (median) | RSS after warm-up MB | peak RSS MB | peak - warm-up MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, hostile), runs in results.items():
        gaps = [g for run, _ in runs for g in run]
        relayed = statistics.median(r for _, r in runs)
        peak, warm = memory[name], baseline[name]
        print(f"| {name} | {'yes' if hostile else 'no'} | {pct(gaps, 0.5) * 1e3:.2f} | {pct(gaps, 0.99) * 1e3:.2f} | {max(gaps) * 1e3:.2f} | "
              f"{relayed / 1e6:,.1f} MB | {warm:.0f} | {peak:.0f} | {peak - warm:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
