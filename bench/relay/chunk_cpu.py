"""CPU per relayed chunk (or per request), this proxy against Envoy (the floor) and optionally other checkouts, side
by side: interleaved rounds at 1, 16 and 64 streams in both client styles (keep-alive, and one
connection per stream), the simulator at compare.py's schedule (TTFT 20 ms, 100 tok/s, 100 tokens).

    ENVOY=.venv-envoy/bin/envoy .venv/bin/python -m bench.relay chunk-cpu [--before DIR] [--also NAME=DIR ...] [--rounds 3] [--seconds 5] [-- proxy flags]
    ENVOY=.venv-envoy/bin/envoy .venv/bin/python -m bench.relay chunk-cpu --per request --tokens 2 --streams 64 --rounds 6 --seconds 4 --before DIR

`--per request --tokens 2`: CPU per request of short streams, the per-request and per-connection work a change moves,
at a resolution 100-token streams do not have; with both client styles the table adds a fresh connection's cost (the
one-connection-each figure less the keep-alive one).

`--also NAME=DIR` adds more checkouts under their own names (e.g. `interpreted=/tmp/pure`, a copy of
this tree without its compiled modules: the mypyc build's share, beside the rest of a change's).

CPU is every thread of each relay's process tree (/proc/PID/task/*/schedstat of it and every process under it: the records
writer and the tokenizer worker are the pod's CPU too; Envoy has none), per chunk the client
received; the per-request work (finish, records, metrics) is in it, as in compare.py. The table
gives medians of the rounds and each system's ratio to Envoy's in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="", help="another checkout to run beside this one (a git worktree)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=DIR", help="more checkouts, each under its name")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--styles", nargs="+", default=["keep-alive", "fresh"], help="keep-alive, fresh (one connection per stream)")
    parser.add_argument("--per", choices=["chunk", "request"], default="chunk", help="what the CPU is divided by")
    parser.add_argument("--tokens", type=int, default=0, help="tokens per stream (default: compare.py's sweep, 100)")
    parser.add_argument("proxy_args", nargs="*", help="extra flags for the proxies, after --")
    args = parser.parse_args()
    sim_port = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    ports = {"envoy": free_port()}
    commands: dict[str, list[str]] = {}
    checkouts = list(common.checkouts(args.before, args.also).items())
    for name, src in checkouts:
        ports[name] = free_port()
        commands[name] = serve_command(src, "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(ports[name]),
                                       "--records-db", str(Path(tempfile.mkdtemp()) / "r.sqlite"), *args.proxy_args)
    commands["envoy"] = common.envoy_command(ports["envoy"], sim_port)
    health = {name: f"http://127.0.0.1:{port}/{'health' if name == 'envoy' else 'healthz'}" for name, port in ports.items()}
    levels = [(streams, style == "fresh") for style in args.styles for streams in args.streams]
    figures: dict[str, dict[tuple[int, bool], list[float]]] = {name: {level: [] for level in levels} for name in ports}
    with contextlib.ExitStack() as stack:
        stack.enter_context(common.simulator(sim_port))
        compare.schedule(compare.SWEEP_SCHEDULE)
        if args.tokens:
            compare.SWEEP_TOKENS = args.tokens
        pids = {name: stack.enter_context(common.process(commands[name], health[name])).pid for name in ports}
        for name in ports:  # warm each path
            asyncio.run(compare.concurrent((ports[name], "/v1"), 8, 1.0))
        for round_ in range(args.rounds):
            for streams, fresh in levels:
                order = list(ports) if round_ % 2 == 0 else list(ports)[::-1]
                for name in order:
                    before = common.cpu_seconds(pids[name])
                    result = asyncio.run(compare.concurrent((ports[name], "/v1"), streams, args.seconds, fresh=fresh))
                    count = result["chunks"] if args.per == "chunk" else len(result["ttft"])
                    figures[name][(streams, fresh)].append((common.cpu_seconds(pids[name]) - before) / max(1, count) * 1e6)
            print(f"round {round_ + 1} of {args.rounds}: " + "; ".join(
                f"{streams}{'f' if fresh else 'k'} " + " ".join(f"{figures[name][(streams, fresh)][-1]:.1f}" for name in ports)
                for streams, fresh in levels) + f" ({', '.join(ports)})", flush=True)
    names = list(ports)
    print(f"\ncommand: ENVOY=.venv-envoy/bin/envoy .venv/bin/python -m bench.relay chunk-cpu {' '.join(sys.argv[1:])}; "
          f"{args.rounds} interleaved rounds of {args.seconds:g} s, medians (µs of CPU per relayed {args.per})")
    print("| streams | client | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for streams, fresh in levels:
        floor = statistics.median(figures["envoy"][(streams, fresh)])
        cells = []
        for name in names:
            value = statistics.median(figures[name][(streams, fresh)])
            cells.append(f"{value:.1f}" if name == "envoy" else f"{value:.1f} ({value / floor:.2f}×)")
        print(f"| {streams} | {'one connection each' if fresh else 'keep-alive'} | " + " | ".join(cells) + " |")
    if args.per == "request" and set(args.styles) == {"keep-alive", "fresh"}:
        print("\n| streams | " + " | ".join(f"{name}: a fresh connection's cost" for name in names) + " |")
        print("|---|" + "---|" * len(names))
        for streams in args.streams:
            print(f"| {streams} | " + " | ".join(f"{statistics.median(figures[name][(streams, True)]) - statistics.median(figures[name][(streams, False)]):.0f}"
                                              for name in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
