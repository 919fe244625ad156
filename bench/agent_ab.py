"""Two (or more) checkouts of this proxy over the same agent conversation, turn by turn: A/B at a resolution agent.py lacks.

    .venv/bin/python bench/agent_ab.py DIR_A DIR_B [--api chat] [--rounds 10]

`bench/agent.py` runs each relay once over a conversation, always in the same order after Envoy: on this VM two
runs of the same tree differ by 5-10%, more than a change of a few percent. Here the checkouts (each a `git
worktree` built with mypyc: `pip install --no-deps --target DIR .`) serve the conversation's 40 turns in rounds:
each turn goes direct, then through every checkout, in an order that alternates per round; per round, each
checkout's CPU (every process: serving, records, worker) per turn. Reported: the median per checkout, the ratio
of the first two medians, and that ratio round by round (its spread is the resolution).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agent  # noqa: E402
import common  # noqa: E402

from proxy.demo import free_port, serve_command  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("sources", nargs="+", help="checkouts to compare (the first two give the ratio)")
    parser.add_argument("--api", default="chat", choices=["chat", "responses", "messages", "gemini"])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    bodies = [(path, json.dumps(body).encode()) for path, body in agent.turn_bodies(args.api, 40)]
    sim, db = free_port(), Path(tempfile.mkdtemp())
    every: dict[str, list[float]] = {src: [] for src in args.sources}
    serving: dict[str, list[float]] = {src: [] for src in args.sources}
    with common.simulator(sim), contextlib.ExitStack() as stack, httpx.Client(timeout=60) as client:
        relays = {}
        for k, src in enumerate(args.sources):
            port = free_port()
            command = serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{sim}/v1", "--port", str(port), "--records-db",
                                    str(db / f"{k}.sqlite"))
            relays[src] = (f"http://127.0.0.1:{port}", stack.enter_context(common.process(command, f"http://127.0.0.1:{port}/healthz")).pid)
        for base, _ in relays.values():  # (the worker's BPE table, the first counts)
            for path, raw in bodies[:3]:
                agent.one(client, base, path, raw)
        time.sleep(2.0)
        for r in range(args.rounds):
            order = args.sources if r % 2 == 0 else args.sources[::-1]
            started = {src: (agent.children_cpu(pid), common.cpu_seconds(pid)) for src, (_, pid) in relays.items()}
            for path, raw in bodies:
                agent.one(client, f"http://127.0.0.1:{sim}", path, raw)
                for src in order:
                    agent.one(client, relays[src][0], path, raw)
            time.sleep(1.5)  # (the last turn's finish, its records)
            for src, (_, pid) in relays.items():
                every[src].append((agent.children_cpu(pid) - started[src][0]) * 1000 / len(bodies))
                serving[src].append((common.cpu_seconds(pid) - started[src][1]) * 1000 / len(bodies))
            print(f"round {r + 1}: " + "  ".join(f"{src}: {every[src][-1]:.2f} ms ({serving[src][-1]:.2f})" for src in args.sources), flush=True)
    print(f"\ncommand: .venv/bin/python bench/agent_ab.py {' '.join(sys.argv[1:])}; ms of CPU per turn, every process (the serving process's)")
    for src in args.sources:
        print(f"{src}: {statistics.median(every[src]):.3f} ({statistics.median(serving[src]):.3f})")
    if len(args.sources) >= 2:
        a, b = every[args.sources[0]], every[args.sources[1]]
        print(f"ratio of the medians, first / second: {statistics.median(a) / statistics.median(b):.3f}; by round: "
              + ", ".join(f"{x / y:.3f}" for x, y in zip(a, b)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
