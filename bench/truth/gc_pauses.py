"""The garbage collector's pauses in the proxy's process under a steady load, and what a client sees
of them: every collection stalls every stream on the event loop for as long as it takes.

    .venv/bin/python -m bench.truth gc-pauses [--before DIR] [--streams 64] [--seconds 150] [--rounds 1] [-- proxy flags]

Each proxy runs with a gc callback (installed before the proxy's code runs) that notes each
collection's generation, wall-clock duration and end instant, written out when the process exits;
only the collections during the measured load count (after a 1 s warm-up). The load is compare.py's
closed loop (the simulator at TTFT 20 ms, 100 tok/s, 100 tokens per request, keep-alive), and the
client notes every gap between content chunks: the schedule's is 10 ms, so what a pause adds shows
at the gaps' tail. Full collections are rare (about one per 150 s at 64 streams here): a run shorter
than that may see none.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Runs in the proxy's process before its own code: a line per collection (generation, seconds, end
# instant), written as it ends (uvicorn ends the process by its SIGTERM, so no exit hook would run).
PROLOGUE = """
import gc, time
_log, _start = open({log!r}, "w", buffering=1), [0.0]
def _note(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        _log.write("%d %.9f %d\\n" % (info["generation"], time.perf_counter() - _start[0], time.monotonic_ns()))
gc.callbacks.append(_note)
"""


def command(src: str, port: int, log: Path, sim_url: str, extra: list[str]) -> list[str]:
    base = serve_command(src, "serve", "--upstream", f"{sim_url}/v1", "--port", str(port),
                         "--records-db", str(Path(tempfile.mkdtemp()) / "r.sqlite"), *extra)
    return [base[0], "-c", PROLOGUE.format(log=str(log)) + base[2], *base[3:]]


def run(src: str, streams: int, seconds: float, sim_url: str, extra: list[str]) -> tuple[list[tuple[int, float]], list[float]]:
    """(generation, pause) of each collection during the load, and the client's gaps between chunks."""
    port, log = free_port(), Path(tempfile.mkdtemp()) / "gc.json"
    with common.process(command(src, port, log, sim_url, extra), f"http://127.0.0.1:{port}/healthz"):
        asyncio.run(compare.concurrent((port, "/v1"), 8, 1.0))
        began = time.monotonic_ns()
        gaps = asyncio.run(compare.concurrent((port, "/v1"), streams, seconds))["gaps"]
        ended = time.monotonic_ns()
    lines = (line.split() for line in log.read_text().splitlines())
    pauses = [(int(generation), float(pause)) for generation, pause, at in lines if began < int(at) <= ended]
    return pauses, gaps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="", help="another checkout to run beside this one (a git worktree)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("proxy_args", nargs="*", help="extra flags for the proxies, after --")
    args = parser.parse_args()
    systems = common.checkouts(args.before)
    sim_port = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    rows = []
    with common.simulator(sim_port):
        compare.schedule(compare.SWEEP_SCHEDULE)
        for round_ in range(args.rounds):
            for name in (list(systems) if round_ % 2 == 0 else list(systems)[::-1]):
                pauses, gaps = run(systems[name], args.streams, args.seconds, compare.SIM_URL, args.proxy_args)
                cells = [name, str(round_ + 1)]
                for generation in (0, 1, 2):
                    ms = [pause * 1e3 for g, pause in pauses if g == generation]
                    cells.append(f"{len(ms)}: {common.pct(ms, 0.5):.2f} / {max(ms):.1f}" if ms else "0")
                cells.append(" / ".join(f"{common.pct(gaps, q) * 1e3:.1f}" for q in (0.99, 0.999)) + f" / {max(gaps) * 1e3:.1f}")
                rows.append(cells)
                print(f"{name}, round {round_ + 1} done", flush=True)
    print(f"\ncommand: .venv/bin/python -m bench.truth gc-pauses {' '.join(sys.argv[1:])}; {args.streams} keep-alive streams for "
          f"{args.seconds:g} s each (collections during the load: how many, p50 / max pause in ms)")
    print(common.table(["system", "round", "young (gen 0)", "gen 1", "full (gen 2)", "client's gap p99 / p99.9 / max (ms)"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
