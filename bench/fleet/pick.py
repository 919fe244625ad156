"""Replicas picked by measured speed: `pick: predicted_ttft` against `fewest_in_flight`, side by side.

    .venv/bin/python -m bench.fleet pick                       # 60 s per mode, 3 requests/s
    .venv/bin/python -m bench.fleet pick --seconds 10 --rounds 1   # a quick look

Two simulated replicas of one model behind one route, each with one prefill unit shared first come
first served (`prefill_queue`: a request waits for the prompts sent before it, as an engine's
prefill does): `fast` prefills 20,000 tokens/s, `slow` five times slower (4,000; `--slow-tps 2000`: ten). A steady open-loop
arrival (Poisson, `--rate` requests/s) of a prompt mix: 75% of 200 tokens, 25% of 6,000, 5 output
tokens each. The same arrival sequence (one seed) through the proxy once per mode, the modes
alternating for `--rounds`; TTFT as the client sees it (the first content chunk), p50 and p99 per
mode, and where the long prompts went.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import pct, process, simulator  # noqa: E402

from proxy.demo import prompt_of  # noqa: E402
from proxy.processes import free_port, serve_command  # noqa: E402

SHORT, LONG, OUTPUT = 200, 6000, 5


def arrivals(rate: float, seconds: float, long_share: float, seed: int) -> list[tuple[float, int]]:
    """(when, prompt tokens) of each request: Poisson arrivals, the same for every mode."""
    rng, at, out = random.Random(seed), 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return out
        out.append((at, LONG if rng.random() < long_share else SHORT))


async def drive(base: str, plan: list[tuple[float, int]]) -> list[tuple[int, float]]:
    """Each request at its time, whatever the others are doing; (prompt tokens, client TTFT)."""
    results: list[tuple[int, float]] = []
    prompts = {n: prompt_of(n) for n in (SHORT, LONG)}
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=500)) as client:
        async def one(at: float, tokens: int, start: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            began = time.perf_counter()
            body = {"model": "sim-7b", "messages": [{"role": "user", "content": prompts[tokens]}], "max_tokens": OUTPUT, "stream": True}
            first = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():  # (read to the end: the replica's stream completes)
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = time.perf_counter() - began
            assert first is not None, "a stream with no content"
            results.append((tokens, first))

        start = time.perf_counter()
        await asyncio.gather(*(one(at, tokens, start) for at, tokens in plan))
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--long-share", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2]), help="the proxy's tree (a before build: a folder)")
    parser.add_argument("--slow-tps", type=float, default=4000.0, help="the slow replica's prefill rate (the fast one's: 20,000)")
    args = parser.parse_args()
    plan = arrivals(args.rate, args.seconds, args.long_share, args.seed)
    fast_port, slow_port = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="llmproxy-pick-"))
    rows = []
    with simulator(fast_port, "--prefill-tps", "20000", "--decode-tps", "200"), simulator(slow_port, "--prefill-tps", f"{args.slow_tps:g}", "--decode-tps", "200"):
        for port in (fast_port, slow_port):
            httpx.post(f"http://127.0.0.1:{port}/sim/config", json={"prefill_queue": True}).raise_for_status()
        for round_ in range(args.rounds):
            for mode in ("fewest_in_flight", "predicted_ttft"):
                path = workdir / f"{mode}.yaml"
                path.write_text(yaml.safe_dump({"upstreams": [{"name": "slow", "url": f"http://127.0.0.1:{slow_port}/v1"},
                                                              {"name": "fast", "url": f"http://127.0.0.1:{fast_port}/v1"}],
                                                "routes": [{"models": ["sim-7b"], "upstreams": ["slow", "fast"], "pick": mode}]}))
                port = free_port()
                with process(serve_command(args.src, "serve", "--routes", str(path), "--port", str(port),
                                           "--records-db", str(workdir / f"{mode}-{round_}.sqlite")), f"http://127.0.0.1:{port}/healthz"):
                    base = f"http://127.0.0.1:{port}"
                    asyncio.run(drive(base, [(i * 0.2, SHORT) for i in range(12)]))  # (a warm-up: each replica measured a few times)
                    results = asyncio.run(drive(base, plan))
                    records = httpx.get(f"{base}/llmproxy/requests", params={"limit": 100000}).json()[12:]
                long_on_slow = sum(1 for r in records if r["upstream"] == "slow" and (r["prompt_tokens"] or 0) > 1000)
                longs = sum(1 for r in records if (r["prompt_tokens"] or 0) > 1000)
                ttfts = sorted(t for _, t in results)
                rows.append((round_ + 1, mode, len(ttfts), statistics.median(ttfts), pct(ttfts, 0.99), f"{long_on_slow}/{longs}"))
                time.sleep(2.0)  # (the replicas' prefill queues empty between runs)
    print(f"command: .venv/bin/python -m bench.fleet pick --rate {args.rate} --seconds {args.seconds} --long-share {args.long_share} "
          f"--rounds {args.rounds} --slow-tps {args.slow_tps:g}; {len(plan)} requests per run")
    print("| round | pick | requests | TTFT p50 s | TTFT p99 s | long prompts on the slow replica |")
    print("|---|---|---|---|---|---|")
    for round_, mode, n, p50, p99, slow in rows:
        print(f"| {round_} | {mode} | {n} | {p50:.3f} | {p99:.3f} | {slow} |")
    for round_ in range(1, args.rounds + 1):
        base, picked = [r for r in rows if r[0] == round_]
        print(f"round {round_}: predicted_ttft p99 {picked[4]:.3f} s vs fewest_in_flight {base[4]:.3f} s: {1 - picked[4] / base[4]:.0%} lower; "
              f"p50 {1 - picked[3] / base[3]:.0%} lower")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
