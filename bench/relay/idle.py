"""What an idle proxy costs: CPU of each checkout's process tree over a quiet stretch, side by side (its timers, its
threads, its records writer and tokenizer worker: a fleet of idle pods pays it all the time).

    .venv/bin/python -m bench.relay idle [--before DIR] [--also NAME=DIR ...] [--seconds 20]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="", help="another checkout to run beside this one (a git worktree)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=DIR", help="more checkouts, each under its name")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    sim = free_port()
    rows = []
    with common.simulator(sim), contextlib.ExitStack() as stack:
        pids = {}
        for name, src in common.checkouts(args.before, args.also).items():
            port = free_port()
            command = serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{sim}/v1", "--port", str(port))
            pids[name] = stack.enter_context(common.process(command, f"http://127.0.0.1:{port}/healthz")).pid
        time.sleep(5.0)  # (start-up settled: the worker's first BPE load, the first records batch)
        tree = {name: common.cpu_seconds(pid) for name, pid in pids.items()}
        own = {name: common.process_cpu_seconds(pid) for name, pid in pids.items()}
        time.sleep(args.seconds)
        for name, pid in pids.items():
            rows.append([name, f"{(common.cpu_seconds(pid) - tree[name]) / args.seconds * 1e3:.3f}",
                         f"{(common.process_cpu_seconds(pid) - own[name]) / args.seconds * 1e3:.3f}"])
    print(f"command: .venv/bin/python -m bench.relay idle {' '.join(sys.argv[1:])}; ms of CPU per second, idle for {args.seconds:g} s")
    print(common.table(["checkout", "process tree", "of it the serving process"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
