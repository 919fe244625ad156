"""Side-by-side overhead benchmark: the same streaming requests directly and through the proxy.

Runs the simulator and the proxy as separate processes on loopback, then sends N interleaved pairs
(direct, via proxy) on a fixed schedule (TTFT 20 ms, then 20 tokens at 200 tok/s), measuring TTFT
and end-to-end time at the client. Also reads the proxy's own records to report how far its
measured TTFT and decode rate are from the injected schedule. Prints a Markdown table.

    .venv/bin/python -m bench.relay overhead [--pairs 300]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.harness import pct, simulator, table  # noqa: E402

from proxy.processes import free_port, serve_command, started  # noqa: E402

TTFT_MS, DECODE_TPS, TOKENS = 20.0, 200.0, 20
BODY = {"model": "sim-7b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS, "stream": True}
HEADERS = {"x-sim-ttft-ms": str(TTFT_MS), "x-sim-decode-tps": str(DECODE_TPS), "authorization": "Bearer bench"}


def one(client: httpx.Client, url: str) -> tuple[float, float]:
    """(ttft, total) in seconds at the client; first content chunk detected in the raw bytes."""
    start = time.perf_counter()
    ttft = None
    with client.stream("POST", url, json=BODY, headers=HEADERS) as response:
        for part in response.iter_raw():
            if ttft is None and b'"content":" ' in part:
                ttft = time.perf_counter() - start
    return ttft or float("nan"), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--src", default="", help="run the proxy from another checkout (e.g. a git worktree of an older commit)")
    parser.add_argument("proxy_args", nargs="*", help="extra flags for the proxy, after --")
    args = parser.parse_args()
    sim_port, proxy_port = free_port(), free_port()
    sim, proxy = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
    serve = ["serve", "--upstream", f"{sim}/v1", "--port", str(proxy_port), "--records", str(args.pairs + 10), *args.proxy_args]
    command = serve_command(args.src, *serve) if args.src else None
    with simulator(sim_port), \
         started(serve, f"{proxy}/healthz", command=command), \
         httpx.Client(timeout=30) as direct_client, httpx.Client(timeout=30) as proxy_client:
        for _ in range(10):  # warm both paths: connections, tokenizer, first-call imports
            one(direct_client, f"{sim}/v1/chat/completions")
            one(proxy_client, f"{proxy}/v1/chat/completions")
        before = len(httpx.get(f"{proxy}/llmproxy/requests", params={"limit": 100000}).json())
        direct, via = [], []
        for i in range(args.pairs):
            order = [(direct, direct_client, sim), (via, proxy_client, proxy)]
            for sink, client, base in order if i % 2 == 0 else order[::-1]:
                sink.append(one(client, f"{base}/v1/chat/completions"))
        time.sleep(0.2)
        records = httpx.get(f"{proxy}/llmproxy/requests", params={"limit": 100000}).json()[before:]
    added_ttft = [(v[0] - d[0]) * 1000 for d, v in zip(direct, via)]
    added_total = [(v[1] - d[1]) * 1000 for d, v in zip(direct, via)]
    ttft_err = [(r["ttft_s"] * 1000 - TTFT_MS) for r in records]
    tps_err = [100 * (r["decode_tokens_per_second"] / DECODE_TPS - 1) for r in records]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; pairs: {args.pairs}")
    print(f"command: .venv/bin/python -m bench.relay overhead --pairs {args.pairs}{' --src ' + args.src if args.src else ''}\n")
    rows = [("client TTFT direct (ms)", [d[0] * 1000 for d in direct], ".3f"), ("client TTFT via proxy (ms)", [v[0] * 1000 for v in via], ".3f"),
            ("added TTFT, paired (ms)", added_ttft, ".3f"), ("added end-to-end, paired (ms)", added_total, ".3f"),
            (f"proxy-measured TTFT - injected {TTFT_MS:.0f} ms (ms)", ttft_err, ".3f"),
            (f"proxy-measured decode tok/s vs injected {DECODE_TPS:.0f} (%)", tps_err, "+.3f")]
    print(table(["figure", "p50", "p99"], [[name, f"{statistics.median(v):{form}}", f"{pct(v, 0.99):{form}}"] for name, v, form in rows]))
    print(f"\nrecords read: {len(records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
