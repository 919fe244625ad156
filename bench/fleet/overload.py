"""Admission control under a 4x overload burst: admitted streams' latency with --max-in-flight at
the saturation point vs without a cap, side by side in one run (arms interleaved, rounds repeated).

    .venv/bin/python -m bench.fleet overload --cap 128 --burst 512 --rounds 4     # in make bench

Schedule (the simulator's own, as bench/relay/compare.py's sweep): TTFT 20 ms, then 100 tokens at 100
tok/s, so every stream should take 1.02 s. Added TTFT = the client's TTFT - the scheduled 20 ms.
The load generator is bench/harness.py's lean raw HTTP client (it parses no JSON), one connection per
stream. The client's TTFT includes the load generator's and the simulator's own CPU on the same 2
cores; the proxy's own time per admitted request (its `proxy` phase, from its records) does not. The simulator shares the 2 cores, so a cap also spares it: in production the engine is on
another machine, and what the cap spares there is the engine's own queue.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import CONTENT, END, pct, request, simulator  # noqa: E402

from proxy.processes import free_port, started  # noqa: E402

SCHEDULE = {"ttft_ms": 20.0, "decode_tps": 100.0}
TOKENS = 100
BODY = json.dumps({"model": "sim-7b", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": TOKENS,
                   "stream": True}).encode()


async def one(port: int) -> tuple[int, float, float | None, float]:
    """(status, seconds to the status line, seconds to the first content chunk, seconds to the end)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request("/v1/chat/completions", BODY))
    status, head_s, first, tail = 0, 0.0, None, b""
    try:
        while data := await reader.read(65536):
            now = time.perf_counter() - start
            if not status:
                status, head_s = int(data[9:12]), now
                if status != 200:
                    break  # a 503 (content-length framed): answered
            if first is None and CONTENT.search(data):
                first = now
            tail = (tail + data)[-16:]
            if tail.endswith(END):
                break
    finally:
        writer.close()
    return status, head_s, first, time.perf_counter() - start


async def burst(port: int, streams: int) -> list[tuple[int, float, float | None, float]]:
    return await asyncio.gather(*(one(port) for _ in range(streams)))


def summary(results: tuple[list[tuple[int, float, float | None, float]], list[float]]) -> dict[str, Any]:
    scheduled = SCHEDULE["ttft_ms"] / 1000
    admitted = [r for r in results[0] if r[0] == 200 and r[2] is not None]
    own = results[1]
    results = results[0]
    rejected = [r for r in results if r[0] == 503]
    added = [(r[2] or 0.0) - scheduled for r in admitted]
    return {"streams": len(results), "admitted": len(admitted), "rejected_503": len(rejected),
            "other": len(results) - len(admitted) - len(rejected),
            "added_ttft_p50_ms": round(pct(added, 0.5) * 1000, 1), "added_ttft_p99_ms": round(pct(added, 0.99) * 1000, 1),
            "proxy_phase_p50_ms": round(pct(own, 0.5) * 1000, 2), "proxy_phase_p99_ms": round(pct(own, 0.99) * 1000, 2),
            "duration_p50_s": round(pct([r[3] for r in admitted], 0.5), 3), "duration_p99_s": round(pct([r[3] for r in admitted], 0.99), 3),
            "rejected_in_p50_ms": round(pct([r[1] for r in rejected], 0.5) * 1000, 1) if rejected else None,
            "rejected_in_p99_ms": round(pct([r[1] for r in rejected], 0.99) * 1000, 1) if rejected else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", type=int, default=128, help="--max-in-flight: the saturation point from bench/RESULTS.md")
    parser.add_argument("--burst", type=int, default=512, help="streams started at once (4x the cap)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sim_port, free, capped = free_port(), free_port(), free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    serve = ["serve", "--upstream", f"{sim}/v1", "--tokenize", "false"]
    # The reference arm: only as many streams as the cap admits, no overload (what admitted streams
    # would see if the excess had never arrived).
    arms: dict[str, tuple[list[tuple[int, float, float | None, float]], list[float]]] = {
        f"reference: {args.cap} streams, no overload": ([], []), f"{args.burst} streams, no cap": ([], []),
        f"{args.burst} streams, --max-in-flight {args.cap}": ([], [])}
    with simulator(sim_port, "--keep-alive-timeout", "3600"), \
         started([*serve, "--port", str(free)], f"http://127.0.0.1:{free}/healthz", quiet=True), \
         started([*serve, "--port", str(capped), "--max-in-flight", str(args.cap)], f"http://127.0.0.1:{capped}/healthz", quiet=True):
        httpx.post(f"{sim}/sim/config", json=SCHEDULE).raise_for_status()
        for port in (free, capped):  # warm: connections and code paths
            asyncio.run(burst(port, 16))
        for round_ in range(args.rounds):
            for name, port, streams in zip(arms, (free, free, capped), (args.cap, args.burst, args.burst)):
                arms[name][0].extend(asyncio.run(burst(port, streams)))
                time.sleep(1.0)  # the proxy's finisher has exported the burst's records
                records = httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": streams}).json()
                arms[name][1].extend(r["phases_s"]["proxy"] for r in records if r["outcome"] == "ok")
    table = {name: summary(results) for name, results in arms.items()}
    print(f"command: .venv/bin/python -m bench.fleet overload --cap {args.cap} --burst {args.burst} --rounds {args.rounds}")
    print(f"streams started at once, {args.rounds} rounds per arm, interleaved; schedule TTFT 20 ms + {TOKENS} tokens at 100 tok/s (1.02 s)")
    print("| arm | admitted | 503 | other | added TTFT p50 / p99 ms (admitted, client) | proxy phase (its own time before and after relaying) p50 / p99 ms | duration p50 / p99 s (admitted) | 503 answered in p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in table.items():
        answered = f"{s['rejected_in_p50_ms']} / {s['rejected_in_p99_ms']}" if s["rejected_in_p50_ms"] is not None else "-"
        print(f"| {name} | {s['admitted']} | {s['rejected_503']} | {s['other']} | {s['added_ttft_p50_ms']} / {s['added_ttft_p99_ms']} | "
              f"{s['proxy_phase_p50_ms']} / {s['proxy_phase_p99_ms']} | "
              f"{s['duration_p50_s']} / {s['duration_p99_s']} | {answered} |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "arms": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
