"""How relayed chunks per second scale from 1 to 2 worker processes on this machine: the same
closed loop of streams through `--workers 1` and `--workers 2`, interleaved rounds.

    .venv/bin/python -m bench.scale workers [--streams 512 --seconds 6 --rounds 3]

Schedule: TTFT 20 ms, then 100 tokens at 100 tok/s per stream (bench/relay/compare.py's sweep), so 512
streams ask for 51,200 chunks/s, beyond what this machine relays. The simulator and the load
generator share the same 2 cores: the figure is this machine's, not a per-core law.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sim_port = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    rates: dict[int, list[float]] = {1: [], 2: []}
    with common.simulator(sim_port):
        compare.schedule(compare.SWEEP_SCHEDULE)
        for round_ in range(args.rounds):
            for workers in ((1, 2) if round_ % 2 == 0 else (2, 1)):
                port = free_port()
                command = [sys.executable, "-m", "proxy", "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(port),
                           "--workers", str(workers), "--records-db", ""]
                with common.process(command, f"http://127.0.0.1:{port}/healthz"):
                    asyncio.run(compare.concurrent((port, "/v1"), 32, 1.0))  # warm every worker
                    result = asyncio.run(compare.concurrent((port, "/v1"), args.streams, args.seconds))
                    rates[workers].append(result["chunks"] / result["seconds"])
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"command: .venv/bin/python -m bench.scale workers --streams {args.streams} --seconds {args.seconds:g} --rounds {args.rounds}")
    print("| workers | relayed chunks/s per round | median |\n|---|---|---|")
    for workers, values in rates.items():
        print(f"| {workers} | {' / '.join(f'{v:,.0f}' for v in values)} | {statistics.median(values):,.0f} |")
    print(f"2 workers / 1 worker: {two / one:.2f}x (demand {args.streams * 100:,} chunks/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
