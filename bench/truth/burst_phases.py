"""A burst of 64 new streams, seen from both sides: the client's TTFT, and the proxy's own phases
for the same requests, from its records (what a burst costs the proxy itself, which a quantile
difference against a separate direct run cannot show on a noisy machine).

    .venv/bin/python -m bench.truth burst-phases [--fresh] [-- proxy flags]
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    fresh = "--fresh" in argv
    streams, rounds = 64, 6
    sim, port = free_port(), free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim}"
    ms = lambda values, q: round(common.pct(values, q) * 1000, 3)  # noqa: E731
    with common.simulator(sim):
        compare.schedule(compare.SWEEP_SCHEDULE)
        direct = asyncio.run(compare.burst((sim, "/v1"), streams, rounds, fresh=fresh))
        cmd = serve_command(str(ROOT), "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(port), *extra)
        with common.process(cmd, f"http://127.0.0.1:{port}/healthz"):
            asyncio.run(compare.burst((port, "/v1"), streams, 2, fresh=fresh))  # warm: the pool holds 64 connections
            proxied = asyncio.run(compare.burst((port, "/v1"), streams, rounds, fresh=fresh))
            records = httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": streams * rounds}).json()
    print(f"bursts of {streams}, {'one connection each' if fresh else 'keep-alive'}, {rounds} rounds")
    print(f"client TTFT p50 / p99 (ms): direct {ms(direct['ttft'], 0.5)} / {ms(direct['ttft'], 0.99)}, "
          f"through the proxy {ms(proxied['ttft'], 0.5)} / {ms(proxied['ttft'], 0.99)}")
    print("| the proxy's records | p50 (ms) | p99 (ms) |\n|---|---|---|")
    rows = [("phase proxy", [r["phases_s"].get("proxy", 0.0) for r in records])]
    rows += [(f"  of it: {part}", [r["proxy_parts_s"][part] for r in records]) for part in ("before", "first_token", "after")]
    rows += [(f"phase {phase}", [r["phases_s"].get(phase, 0.0) for r in records]) for phase in ("client", "network", "tokenize", "prefill")]
    rows += [("ttft", [r["ttft_s"] for r in records])]
    for name, values in rows:
        print(f"| {name} | {ms(values, 0.5)} | {ms(values, 0.99)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
