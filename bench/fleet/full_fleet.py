"""A full fleet is not a sick one: goodput with ejection on against the same fleet with ejection off, side by side.

    .venv/bin/python -m bench.fleet full-fleet                        # 4 windows of 5 s per side, both Retry-After cases
    .venv/bin/python -m bench.fleet full-fleet --src /tmp/bB          # a before tree (a folder), the same way

Four simulated replicas of one model, each refusing a fifth stream in flight with a 429 (`max_streams: 4`: a
fleet of 16 streams), with `Retry-After: 1` and with none; 24 clients looping on streams of 10 tokens
(50 ms to the first, 100 tok/s), `retries: 1`, `first_token_deadline: 2`. Two proxies on the one fleet, one
with ejection off; windows alternate between them (off, on, on, off, ...), so that each goes first as often
as the other. Per side: streams served whole, and the fewest requests any replica received in a window;
for the ejection-on proxy, its ejections and the replicas it shows set aside at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import process, simulator  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

BODY = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}


async def window(base: str, seconds: float, clients: int) -> int:
    """Streams served whole by `clients` looping for `seconds`."""
    served = 0
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=httpx.Limits(max_connections=clients)) as client:
        async def loop() -> None:
            nonlocal served
            while time.monotonic() < stop:
                async with client.stream("POST", "/v1/chat/completions", json=BODY, headers={"x-sim-ttft-ms": "50"}) as response:
                    text = (await response.aread()).decode()
                if response.status_code == 200 and text.count('"content":"') - text.count('"content":""') == 10:
                    served += 1
                else:
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(loop() for _ in range(clients)))
    return served


def requests_of(ports: list[int]) -> list[int]:
    return [httpx.get(f"http://127.0.0.1:{p}/sim/stats").json()["requests"] for p in ports]


def scraped(base: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0, help="one window")
    parser.add_argument("--rounds", type=int, default=2, help="each an off, on, on, off sequence of windows")
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2]), help="the proxy's tree")
    args = parser.parse_args()
    ports = [free_port() for _ in range(4)]
    workdir = Path(tempfile.mkdtemp(prefix="llmproxy-full-fleet-"))
    rows = []
    with contextlib.ExitStack() as running:
        for p in ports:
            running.enter_context(simulator(p))
        for retry_after in ("1", ""):
            for p in ports:
                httpx.post(f"http://127.0.0.1:{p}/sim/config", json={"max_streams": 4, "retry_after": retry_after}).raise_for_status()
            proxies = contextlib.ExitStack()
            bases = {}
            for side in ("off", "on"):
                path = workdir / f"{side}-{retry_after or 'none'}.yaml"
                route = {"models": ["sim-7b"], "upstreams": [f"r{i}" for i in range(4)], "retries": 1, "first_token_deadline": 2.0}
                path.write_text(yaml.safe_dump({"upstreams": [{"name": f"r{i}", "url": f"http://127.0.0.1:{p}/v1"} for i, p in enumerate(ports)],
                                                "routes": [route], **({"ejection": "off"} if side == "off" else {})}))
                port = free_port()
                proxies.enter_context(process(serve_command(args.src, "serve", "--routes", str(path), "--port", str(port)),
                                              f"http://127.0.0.1:{port}/healthz"))
                bases[side] = f"http://127.0.0.1:{port}"
            served = {"off": 0, "on": 0}
            fewest = {"off": 10**9, "on": 10**9}
            with proxies:
                for _ in range(args.rounds):
                    for side in ("off", "on", "on", "off"):
                        before = requests_of(ports)
                        served[side] += asyncio.run(window(bases[side], args.seconds, args.clients))
                        fewest[side] = min(fewest[side], *(a - b for a, b in zip(requests_of(ports), before)))
                ejections = scraped(bases["on"], "llmproxy_upstream_ejections_total")
                aside = scraped(bases["on"], 'llmproxy_upstream_state{state="ejected"')
            rows.append((retry_after or "none", served["off"], served["on"], fewest["off"], fewest["on"], ejections, aside))
    print(f"command: .venv/bin/python -m bench.fleet full-fleet --seconds {args.seconds:g} --rounds {args.rounds} --clients {args.clients}"
          f"{' --src ' + args.src if args.src != str(Path(__file__).resolve().parents[2]) else ''}")
    print("| Retry-After | streams, ejection off | streams, ejection on | on / off | fewest requests a replica got in a window (off / on) | ejections (on) | set aside at the end (on) |")
    print("|---|---|---|---|---|---|---|")
    for retry_after, off, on, few_off, few_on, ejections, aside in rows:
        print(f"| {retry_after} | {off} | {on} | {on / off:.2f}x | {few_off} / {few_on} | {ejections:.0f} | {aside:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
