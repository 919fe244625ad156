"""The listener's cost per accepted connection: requests per second when every request opens a new
connection (`Connection: close`), this checkout vs another one (`--before DIR`, e.g. a worktree of
the commit before acceptor.py), interleaved in one run.

    .venv/bin/python -m bench.relay accept --before /tmp/before
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
from bench.harness import ROOT, process, request, simulator  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

REQUEST = request("/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}', {"connection": "close"})


async def rate(port: int, seconds: float, concurrency: int) -> float:
    done, deadline = 0, time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(REQUEST)
            await reader.read()  # to the server's close
            writer.close()
            done += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="another checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    sim_port = free_port()
    ports: dict[str, int] = {}
    with simulator(sim_port), contextlib.ExitStack() as stack:
        for name, src in (("before", args.before), ("this checkout", str(ROOT))):
            ports[name] = free_port()
            stack.enter_context(process(serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1",
                                                      "--port", str(ports[name]), "--tokenize", "false"), f"http://127.0.0.1:{ports[name]}/healthz"))
        rates: dict[str, list[float]] = {name: [] for name in ports}
        for _ in range(args.rounds):
            for name, port in ports.items():
                rates[name].append(asyncio.run(rate(port, args.seconds, args.concurrency)))
    print(f"command: .venv/bin/python -m bench.relay accept --before {args.before} --rounds {args.rounds} --seconds {args.seconds:g} "
          f"--concurrency {args.concurrency}")
    for name, values in rates.items():
        print(f"{name}: new-connection requests/s per round {[round(v) for v in values]}, median {statistics.median(values):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
