"""What tracing costs at 64 streams, measured interleaved so that drift on the machine cancels.

    .venv/bin/python bench/tracing_cost.py                 # this checkout
    .venv/bin/python bench/tracing_cost.py --src /tmp/old  # another checkout, same harness

Two proxies from the same checkout run side by side in front of one simulator: metrics only, and
the defaults with tracing on (OTLP/HTTP to a local sink, --token-spans off). Each round runs, in
turn, direct, metrics-only and tracing: a 64-stream closed loop (TTFT 20 ms, 100 tokens at
100 tok/s) and bursts of 64 streams started at once. Figures are medians over rounds of the
per-round added TTFT (system minus direct of the same round), and the proxy's CPU per relayed chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import compare  # noqa: E402

import httpx  # noqa: E402

from proxy.demo import free_port, serve_command  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    sim_port = free_port()
    sink = compare.Sink()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    sim = [sys.executable, "-m", "proxy", "simulate", "--port", str(sim_port)]
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in ("metrics only", "tracing on")}
    with compare.process(sim, f"{compare.SIM_URL}/health"), contextlib.closing(sink):
        compare.schedule(compare.SWEEP_SCHEDULE)
        ports = {"metrics only": free_port(), "tracing on": free_port()}
        envs = {"metrics only": {}, "tracing on": {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url}}
        commands = {name: serve_command(args.src, "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(port))
                    for name, port in ports.items()}
        with compare.process(commands["metrics only"], f"http://127.0.0.1:{ports['metrics only']}/healthz", envs["metrics only"]) as a, \
                compare.process(commands["tracing on"], f"http://127.0.0.1:{ports['tracing on']}/healthz", envs["tracing on"]) as b:
            pids = {"metrics only": a.pid, "tracing on": b.pid}
            for name, port in ports.items():  # warm both
                asyncio.run(compare.concurrent((port, "/v1"), args.streams, 1.0))
            for round_ in range(args.rounds):
                direct = asyncio.run(compare.concurrent((sim_port, "/v1"), args.streams, args.seconds))
                direct_burst = asyncio.run(compare.burst((sim_port, "/v1"), args.streams, 2))
                order = list(ports) if round_ % 2 == 0 else list(ports)[::-1]
                for name in order:
                    before = compare.cpu_seconds(pids[name])
                    loop = asyncio.run(compare.concurrent((ports[name], "/v1"), args.streams, args.seconds))
                    cpu = (compare.cpu_seconds(pids[name]) - before) / max(1, loop["chunks"])
                    bursts = asyncio.run(compare.burst((ports[name], "/v1"), args.streams, 2))
                    f = figures[name]
                    f.setdefault("added TTFT p50, closed loop (ms)", []).append(1000 * (compare.pct(loop["ttft"], 0.5) - compare.pct(direct["ttft"], 0.5)))
                    f.setdefault("added TTFT p99, closed loop (ms)", []).append(1000 * (compare.pct(loop["ttft"], 0.99) - compare.pct(direct["ttft"], 0.99)))
                    f.setdefault("added TTFT p50, bursts (ms)", []).append(1000 * (compare.pct(bursts["ttft"], 0.5) - compare.pct(direct_burst["ttft"], 0.5)))
                    f.setdefault("added TTFT p99, bursts (ms)", []).append(1000 * (compare.pct(bursts["ttft"], 0.99) - compare.pct(direct_burst["ttft"], 0.99)))
                    f.setdefault("proxy CPU per chunk (µs)", []).append(cpu * 1e6)
                    records = httpx.get(f"http://127.0.0.1:{ports[name]}/llmproxy/requests", params={"limit": 200}).json()
                    f.setdefault("TTFT p50 as the proxy measured it (ms)", []).append(
                        1000 * statistics.median(r["ttft_s"] for r in records if r.get("ttft_s") is not None))
                print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"src: {args.src}; {args.streams} streams, {args.rounds} interleaved rounds of {args.seconds} s; medians over rounds")
    print("| figure | metrics only | tracing on | tracing / metrics only |")
    print("|---|---|---|---|")
    for key in figures["metrics only"]:
        m, t = statistics.median(figures["metrics only"][key]), statistics.median(figures["tracing on"][key])
        print(f"| {key} | {m:.2f} | {t:.2f} | {t / m:.2f} |" if m > 0 else f"| {key} | {m:.2f} | {t:.2f} | n/a |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
