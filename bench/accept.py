"""The listener's cost per accepted connection: requests per second when every request opens a new
connection (`Connection: close`), this checkout vs another one (`--before DIR`, e.g. a worktree of
the commit before acceptor.py), interleaved in one run.

    .venv/bin/python bench/accept.py --before /tmp/before
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from proxy.demo import free_port, serve_command, wait_healthy  # noqa: E402

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))


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
    sim = subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "--port", str(sim_port)], cwd=ROOT, stderr=subprocess.DEVNULL)
    proxies: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    try:
        wait_healthy(f"http://127.0.0.1:{sim_port}/health", sim)
        for name, src in (("before", args.before), ("this checkout", str(ROOT))):
            port = free_port()
            proxies[name] = (port, subprocess.Popen(serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1",
                                                                  "--port", str(port), "--tokenize", "false")))
            wait_healthy(f"http://127.0.0.1:{port}/healthz", proxies[name][1])
        rates: dict[str, list[float]] = {name: [] for name in proxies}
        for _ in range(args.rounds):
            for name, (port, _) in proxies.items():
                rates[name].append(asyncio.run(rate(port, args.seconds, args.concurrency)))
    finally:
        for _, process in proxies.values():
            process.terminate()
        sim.terminate()
    print(f"command: .venv/bin/python bench/accept.py --before {args.before} --rounds {args.rounds} --seconds {args.seconds:g} "
          f"--concurrency {args.concurrency}")
    for name, values in rates.items():
        print(f"{name}: new-connection requests/s per round {[round(v) for v in values]}, median {statistics.median(values):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
