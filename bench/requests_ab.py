"""CPU per request of two (or more) checkouts of this proxy and Envoy, side by side, short streams: the per-request
and per-connection work a change moves, at a resolution chunk_cpu.py (100-token streams) does not have.

    ENVOY=.venv-envoy/bin/envoy .venv/bin/python bench/requests_ab.py DIR_A DIR_B [--streams 64] [--tokens 2] [--rounds 6] [--seconds 4]

Each checkout (a `git worktree` built with mypyc: `pip install --no-deps --target DIR .`) and Envoy serve
compare.py's closed loop of `--streams` streams of `--tokens` tokens, in both client styles (keep-alive, and one
connection per request), for `--seconds` each, in rounds whose order alternates. CPU is every thread of the serving
process (/proc/PID/task/*/schedstat) per request. Reported: each round's figures, then medians and the ratio to
Envoy's; a fresh connection's cost is the one-connection-each figure less the keep-alive one.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import compare  # noqa: E402

from proxy.demo import free_port, serve_command  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("sources", nargs="+", help="checkouts to compare")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    sim = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim}"
    db = Path(tempfile.mkdtemp())
    names = ["envoy"] + [f"{k}:{Path(src).name}" for k, src in enumerate(args.sources)]
    figures: dict[tuple[str, bool], list[float]] = {(name, fresh): [] for name in names for fresh in (False, True)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(common.simulator(sim))
        port = free_port()
        envoy = compare.envoy_command(port, sim)
        relays = {"envoy": (port, stack.enter_context(common.process(envoy, f"http://127.0.0.1:{port}/health")).pid)}
        for name, src in zip(names[1:], args.sources):
            port = free_port()
            command = serve_command(src, "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(port), "--records-db",
                                    str(db / f"{len(relays)}.sqlite"))
            relays[name] = (port, stack.enter_context(common.process(command, f"http://127.0.0.1:{port}/healthz")).pid)
        compare.schedule(compare.SWEEP_SCHEDULE)
        compare.SWEEP_TOKENS = args.tokens
        for port, _ in relays.values():  # (warm: the pools, the first counts)
            asyncio.run(compare.concurrent((port, "/v1"), args.streams, 1.0))
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for fresh in (False, True):
                for name in order:
                    port, pid = relays[name]
                    before = common.cpu_seconds(pid)
                    result = asyncio.run(compare.concurrent((port, "/v1"), args.streams, args.seconds, fresh=fresh))
                    figures[(name, fresh)].append((common.cpu_seconds(pid) - before) / max(1, len(result["ttft"])) * 1e6)
            print(f"round {r + 1} of {args.rounds}: " + "; ".join(
                f"{name} {figures[(name, False)][-1]:.0f} / {figures[(name, True)][-1]:.0f}" for name in names)
                + " (µs a request: keep-alive / one connection each)", flush=True)
    print(f"\ncommand: {' '.join(sys.argv)}; {args.streams} streams of {args.tokens} tokens, medians of {args.rounds} rounds "
          "(µs of the serving process's CPU a request)")
    print("| relay | keep-alive | one connection each | a fresh connection's cost |")
    print("|---|---|---|---|")
    floor = {fresh: statistics.median(figures[("envoy", fresh)]) for fresh in (False, True)}
    for name in names:
        kept, fresh = (statistics.median(figures[(name, style)]) for style in (False, True))
        print(f"| {name} | {kept:.0f} ({kept / floor[False]:.2f}×) | {fresh:.0f} ({fresh / floor[True]:.2f}×) | {fresh - kept:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
