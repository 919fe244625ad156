"""What tracing and each per-token stamp representation cost at 64 streams, measured interleaved
so that drift on the machine cancels.

    .venv/bin/python -m bench.relay tracing-cost                 # this checkout
    .venv/bin/python -m bench.relay tracing-cost --src /tmp/old --modes metrics-only off   # another checkout

Proxies from the same checkout run side by side in front of one simulator: metrics only (no
tracing), and tracing on (OTLP/HTTP to a local sink) with each `--token-spans` mode: off (no
stamps), offsets (the default: arrays on the decode span), events (a span event per chunk), spans
(a span per chunk). Each round runs, in turn, direct and every proxy: a 64-stream closed loop
(TTFT 20 ms, 100 tokens at 100 tok/s) and bursts of 64 streams started at once. Figures are
medians over rounds of the per-round added TTFT (system minus direct of the same round), and the
proxy's CPU per relayed chunk; the last columns divide each mode by `off` (tracing, no stamps).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

import httpx  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2]))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--modes", nargs="+", default=["metrics-only", "off", "offsets", "events", "spans"])
    args = parser.parse_args()
    sim_port = free_port()
    sink = common.Sink()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in args.modes}
    with common.simulator(sim_port), contextlib.closing(sink):
        compare.schedule(compare.SWEEP_SCHEDULE)
        ports = {name: free_port() for name in args.modes}
        envs = {name: {} if name == "metrics-only" else {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url} for name in args.modes}
        commands = {name: serve_command(args.src, "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(port),
                                        *([] if name == "metrics-only" else ["--token-spans", name]))
                    for name, port in ports.items()}
        with contextlib.ExitStack() as stack:
            pids = {name: stack.enter_context(common.process(commands[name], f"http://127.0.0.1:{ports[name]}/healthz", envs[name])).pid
                    for name in args.modes}
            for name, port in ports.items():  # warm every one
                asyncio.run(compare.concurrent((port, "/v1"), args.streams, 1.0))
            for round_ in range(args.rounds):
                direct = asyncio.run(compare.concurrent((sim_port, "/v1"), args.streams, args.seconds))
                direct_burst = asyncio.run(compare.burst((sim_port, "/v1"), args.streams, 2))
                order = list(ports)[round_ % len(ports):] + list(ports)[:round_ % len(ports)]  # rotated per round
                for name in order:
                    before, before_tree = common.process_cpu_seconds(pids[name]), common.cpu_seconds(pids[name])
                    loop = asyncio.run(compare.concurrent((ports[name], "/v1"), args.streams, args.seconds))
                    time.sleep(0.5)  # the last spans reach the export worker
                    cpu = (common.process_cpu_seconds(pids[name]) - before) / max(1, loop["chunks"])
                    cpu_tree = (common.cpu_seconds(pids[name]) - before_tree) / max(1, loop["chunks"])
                    bursts = asyncio.run(compare.burst((ports[name], "/v1"), args.streams, 2))
                    f = figures[name]
                    f.setdefault("added TTFT p50, closed loop (ms)", []).append(1000 * (common.pct(loop["ttft"], 0.5) - common.pct(direct["ttft"], 0.5)))
                    f.setdefault("added TTFT p99, closed loop (ms)", []).append(1000 * (common.pct(loop["ttft"], 0.99) - common.pct(direct["ttft"], 0.99)))
                    f.setdefault("added TTFT p50, bursts (ms)", []).append(1000 * (common.pct(bursts["ttft"], 0.5) - common.pct(direct_burst["ttft"], 0.5)))
                    f.setdefault("added TTFT p99, bursts (ms)", []).append(1000 * (common.pct(bursts["ttft"], 0.99) - common.pct(direct_burst["ttft"], 0.99)))
                    f.setdefault("proxy CPU per chunk (µs)", []).append(cpu * 1e6)
                    f.setdefault("with its export worker (µs)", []).append(cpu_tree * 1e6)
                    records = httpx.get(f"http://127.0.0.1:{ports[name]}/llmproxy/requests", params={"limit": 200}).json()
                    f.setdefault("TTFT p50 as the proxy measured it (ms)", []).append(
                        1000 * statistics.median(r["ttft_s"] for r in records if r.get("ttft_s") is not None))
                print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"src: {args.src}; {args.streams} streams, {args.rounds} interleaved rounds of {args.seconds} s; medians over rounds")
    base = "off" if "off" in figures else args.modes[0]
    print("| figure | " + " | ".join(args.modes) + " | " + " | ".join(f"{m} / {base}" for m in args.modes if m != base) + " |")
    print("|---" * (2 * len(args.modes)) + "|")
    for key in figures[args.modes[0]]:
        medians = {m: statistics.median(figures[m][key]) for m in args.modes}
        ratios = [f"{medians[m] / medians[base]:.2f}" if medians[base] > 0 else "n/a" for m in args.modes if m != base]
        print(f"| {key} | " + " | ".join(f"{medians[m]:.2f}" for m in args.modes) + " | " + " | ".join(ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
