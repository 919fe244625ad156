"""What the records database costs the request path: the same proxy with records on (the default)
and off (`--records-db ''`), side by side, interleaved rounds. Non-streaming requests per second
(16 keep-alive clients, 1 output token: the per-request work dominates) and the CPU per request of
the serving process (its threads) and of its records writer's process (records/outbox.py; the
previous design wrote from a thread of the serving process, so its figure is all in the first).

    .venv/bin/python -m bench.store records-cost [--before DIR]

`--before DIR` adds the same proxy, records on, from another checkout (`git worktree add DIR COMMIT`),
to the same interleaved rounds: what a change to the records costs, side by side.
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402


def main(rounds: int = 5, seconds: float = 5.0) -> int:
    import argparse
    import contextlib

    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="", help="another checkout: its proxy, records on, in the same rounds")
    args = parser.parse_args()
    sim_port = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    here = str(Path(__file__).resolve().parents[2])
    folder = Path(tempfile.mkdtemp(prefix="llmproxy-bench-"))
    arms = {"records off": (here, ["--records-db", ""]), "records on": (here, ["--records-db", str(folder / "records.sqlite")])}
    if args.before:
        arms["records on, before"] = (args.before, ["--records-db", str(folder / "before.sqlite")])
    ports = {name: free_port() for name in arms}
    figures: dict[str, dict[str, list[float]]] = {name: {"rps": [], "cpu_us": [], "writer_us": []} for name in arms}
    with common.simulator(sim_port), contextlib.ExitStack() as stack:
        pids = {}
        for name, (src, flags) in arms.items():
            command = serve_command(src, "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(ports[name]), *flags)
            pids[name] = stack.enter_context(common.process(command, f"http://127.0.0.1:{ports[name]}/healthz")).pid
        for name in arms:
            asyncio.run(compare.non_streaming((ports[name], "/v1"), 1.0))
        for round_ in range(rounds):
            for name in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                children = common.descendants(pids[name])
                before, writer_before = common.process_cpu_seconds(pids[name]), sum(common.process_cpu_seconds(c) for c in children)
                result = asyncio.run(compare.non_streaming((ports[name], "/v1"), seconds))
                requests = result["rps"] * seconds
                figures[name]["rps"].append(result["rps"])
                figures[name]["cpu_us"].append((common.process_cpu_seconds(pids[name]) - before) / max(1.0, requests) * 1e6)
                figures[name]["writer_us"].append((sum(common.process_cpu_seconds(c) for c in children) - writer_before) / max(1.0, requests) * 1e6)
    print(f"command: .venv/bin/python -m bench.store records-cost{' --before ' + args.before if args.before else ''}; {rounds} interleaved "
          f"rounds of {seconds:g} s, medians")
    print("| | non-streaming req/s | serving process CPU µs per request | its records writer process's |")
    print("|---|---|---|---|")
    for name, f in figures.items():
        print(f"| {name} | {statistics.median(f['rps']):,.0f} | {statistics.median(f['cpu_us']):.0f} | {statistics.median(f['writer_us']):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
