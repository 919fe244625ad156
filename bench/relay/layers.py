"""Where a relayed request's CPU goes, layer by layer: Envoy, a bare Python relay, the same under uvicorn, the proxy.

    ENVOY=.venv-envoy/bin/envoy .venv/bin/python -m bench.relay layers [--rounds 3] [--seconds 4] [--streams 16 64] [--turns 40]

Side by side, one run, interleaved rounds (the order reversed every other round):
- Envoy 1.40, the floor the issue measures against;
- `floor`: bench/relay/floor.py, a relay on the proxy's own parts (uvloop, httptools) that measures nothing;
- `floor+asgi`: the same relay as an ASGI app under uvicorn, the server the proxy runs on;
- `proxy`: this proxy as installed (records on, SQLite, no OTLP endpoint);
- `proxy, no finish`: the same with `Telemetry.finish` patched out before `main()` (no counts, split,
  metrics, records or SLO verdict: what the per-request telemetry costs, records process included).

For each, at keep-alive streams (compare.py's client and schedule: TTFT 20 ms, 100 tok/s), a 2-token
and a 100-token run solved into CPU per request and per chunk (the serving process's threads, as
chunk_cpu.py counts them); then bench/relay/agent.py's chat conversation (a 208 KB body a turn, 20 chunks)
turn by turn, CPU per turn of every process of each relay (records writer and tokenizer worker included).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import proxy  # noqa: E402,F401  (before agent.py, which puts the checkout first on the path)
from bench.relay import agent  # noqa: E402
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402
import httpx  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NO_FINISH = ("import sys; sys.path.insert(0, {src!r})\nfrom proxy import telemetry\ntelemetry.Telemetry.finish = lambda self, ctx: None\n"
             "from proxy.cli import main; sys.exit(main())")


def every_cpu(pid: int) -> float:
    return common.cpu_seconds(pid)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--turns", type=int, default=40)
    args = parser.parse_args()
    sim_port = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    names = ["envoy", "floor", "floor+asgi", "proxy", "proxy, no finish"]
    ports = {name: free_port() for name in names}
    serve = ["serve", "--upstream", f"{compare.SIM_URL}/v1"]
    commands = {
        "envoy": common.envoy_command(ports["envoy"], sim_port),
        "floor": [sys.executable, str(ROOT / "bench" / "floor.py"), str(ports["floor"]), str(sim_port)],
        "floor+asgi": [sys.executable, str(ROOT / "bench" / "floor.py"), str(ports["floor+asgi"]), str(sim_port), "--asgi"],
        "proxy": serve_command(str(ROOT), *serve, "--port", str(ports["proxy"]), "--records-db", str(Path(tempfile.mkdtemp()) / "r.sqlite")),
        "proxy, no finish": [sys.executable, "-c", NO_FINISH.format(src=str(ROOT)), *serve, "--port", str(ports["proxy, no finish"]),
                             "--records-db", str(Path(tempfile.mkdtemp()) / "r.sqlite")],
    }
    health = {name: f"http://127.0.0.1:{port}/{'healthz' if name.startswith('proxy') else 'health'}" for name, port in ports.items()}
    solve: dict[str, dict[tuple[int, int], list[tuple[float, float]]]] = {
        name: {(streams, tokens): [] for streams in args.streams for tokens in (2, 100)} for name in names}
    turns: dict[str, list[float]] = {name: [] for name in names}
    bodies = [(path, json.dumps(body).encode()) for path, body in agent.turn_bodies("chat", args.turns)]
    warm = [(path, json.dumps(body).encode()) for path, body in agent.turn_bodies("chat", 3)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(common.simulator(sim_port))
        compare.schedule(compare.SWEEP_SCHEDULE)
        pids = {name: stack.enter_context(common.process(commands[name], health[name])).pid for name in names}
        client = stack.enter_context(httpx.Client(timeout=60))
        for name in names:
            asyncio.run(compare.concurrent((ports[name], "/v1"), 8, 1.0))
            for path, body in warm:
                agent.one(client, f"http://127.0.0.1:{ports[name]}", path, body)
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for streams in args.streams:
                for tokens in (2, 100):
                    compare.SWEEP_TOKENS = tokens
                    for name in order:
                        before = common.cpu_seconds(pids[name])
                        out = asyncio.run(compare.concurrent((ports[name], "/v1"), streams, args.seconds))
                        requests = max(1, len(out["ttft"]))
                        solve[name][(streams, tokens)].append(((common.cpu_seconds(pids[name]) - before) / requests, out["chunks"] / requests))
            for name in order:
                time.sleep(0.3)
                before = every_cpu(pids[name])
                for path, body in bodies:
                    agent.one(client, f"http://127.0.0.1:{ports[name]}", path, body)
                time.sleep(0.4)  # (the records writer's batch)
                turns[name].append((every_cpu(pids[name]) - before) / len(bodies) * 1e3)
            print(f"round {round_ + 1} of {args.rounds}", flush=True)
    print(f"\ncommand: ENVOY=.venv-envoy/bin/envoy .venv/bin/python -m bench.relay layers {' '.join(sys.argv[1:])}; "
          f"{args.rounds} interleaved rounds, medians")
    print("| relay | " + " | ".join(f"{s} streams: µs per request / per chunk / per chunk at 100 tokens" for s in args.streams)
          + " | agent turn, every process (ms) |")
    print("|---|" + "---|" * (len(args.streams) + 1))
    envoy_turn = statistics.median(turns["envoy"])
    for name in names:
        cells = []
        for streams in args.streams:
            (cpu2, chunks2), (cpu100, chunks100) = [tuple(statistics.median(x[i] for x in solve[name][(streams, tokens)]) for i in (0, 1))
                                                    for tokens in (2, 100)]
            per_chunk = (cpu100 - cpu2) / max(1e-9, chunks100 - chunks2)
            cells.append(f"{(cpu2 - per_chunk * chunks2) * 1e6:.0f} / {per_chunk * 1e6:.1f} / {cpu100 / chunks100 * 1e6:.1f}")
        turn = statistics.median(turns[name])
        print(f"| {name} | " + " | ".join(cells) + f" | {turn:.2f} ({turn / envoy_turn:.2f}×) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
