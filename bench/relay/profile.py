"""Where the proxy's CPU goes, by function, under one load shape: py-spy on the proxy process.

    .venv/bin/python -m bench.relay profile --shape burst --streams 64          # bursts of 64 new streams
    .venv/bin/python -m bench.relay profile --shape steady --streams 64         # 64 streams, closed loop
    .venv/bin/python -m bench.relay profile --shape burst --fresh -- --token-spans off   # proxy flags after --
    .venv/bin/python -m bench.relay profile --shape agent --api chat            # bench/relay/agent.py's turns, one at a time

The load is compare.py's (the raw client, the simulator at TTFT 20 ms then 100 tok/s); `--fresh`
opens one connection per stream instead of keeping them. py-spy samples every thread of the
proxy (`--native` off: Python frames) at `--rate` Hz while the load runs; the report is the
share of samples by the innermost frame in a proxy, uvicorn, httpcore... module ("self"), and by
any frame on the stack ("total"), so a line reads "x% of the proxy's CPU was under this".
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PY_SPY = str(Path(sys.executable).parent / "py-spy")


def agent_turns(port: int, api: str, seconds: float) -> int:
    """bench/relay/agent.py's conversation (a 170 KB system prompt, 30 tools), turn after turn, for `seconds`:
    the per-request work of agent-sized bodies."""
    import agent
    import httpx

    bodies = [(path, json.dumps(body).encode()) for path, body in agent.turn_bodies(api, 40)]
    done, deadline = 0, time.perf_counter() + seconds
    with httpx.Client(timeout=60) as client:
        while time.perf_counter() < deadline:
            path, raw = bodies[done % len(bodies)]
            agent.one(client, f"http://127.0.0.1:{port}", path, raw)
            done += 1
    return done


async def load(target: tuple[int, str], shape: str, streams: int, seconds: float, fresh: bool, tokens: int, api: str = "chat") -> int:
    if shape == "agent":
        return await asyncio.to_thread(agent_turns, target[0], api, seconds)
    if shape == "burst":
        rounds = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            await compare.burst(target, streams, 1, fresh=fresh, tokens=tokens)
            rounds += 1
        return rounds
    compare.SWEEP_TOKENS = tokens  # (steady: each closed-loop request asks for this many)
    result = await compare.concurrent(target, streams, seconds, fresh=fresh)
    return int(result["chunks"])


def frames(line: str) -> tuple[list[str], int]:
    stack, _, count = line.rpartition(" ")
    return stack.split(";"), int(count)


def report(raw: Path, top: int) -> None:
    self_samples: collections.Counter[str] = collections.Counter()
    total_samples: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = frames(line)
        samples += count
        names = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].split("/")[-1] + ")" if " (" in f else f for f in stack]
        self_samples[names[-1]] += count
        for name in set(names):
            total_samples[name] += count
    print(f"{samples} samples")
    for title, counter in (("self", self_samples), ("total", total_samples)):
        print(f"\n## by {title}")
        for name, count in counter.most_common(top):
            print(f"{100 * count / max(1, samples):6.1f}%  {name}")


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=["burst", "steady", "agent"], default="burst")
    parser.add_argument("--api", choices=["chat", "responses", "messages", "gemini"], default="chat", help="the agent shape's API")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=250)
    parser.add_argument("--fresh", action="store_true", help="one connection per stream")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--tokens", type=int, default=compare.SWEEP_TOKENS, help="per request: 1 leaves only the per-request path")
    parser.add_argument("--native", action="store_true", help="C frames too (uvloop, libuv, the kernel entry points)")
    parser.add_argument("--src", default=str(ROOT), help="the checkout to profile")
    parser.add_argument("--no-tracing", action="store_true", help="the defaults: no OTLP endpoint, so no spans")
    args = parser.parse_args(argv)
    sim_port, port = free_port(), free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    sink = common.Sink()
    raw = Path(tempfile.mkdtemp()) / "profile.txt"
    try:
        with common.simulator(sim_port):
            compare.schedule(compare.SWEEP_SCHEDULE)
            cmd = serve_command(args.src, "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(port), *extra)
            with common.process(cmd, f"http://127.0.0.1:{port}/healthz", {} if args.no_tracing else {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url}) as proc:
                asyncio.run(load((port, "/v1"), args.shape, args.streams, 2.0, args.fresh, args.tokens, args.api))  # warm
                spy = subprocess.Popen([PY_SPY, "record", "--pid", str(proc.pid), "--rate", str(args.rate), "--format", "raw",
                                        "--output", str(raw), "--duration", str(int(args.seconds)), "--threads", *(["--native"] if args.native else ["--nonblocking"])],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                before = common.cpu_seconds(proc.pid)
                done = asyncio.run(load((port, "/v1"), args.shape, args.streams, args.seconds, args.fresh, args.tokens, args.api))
                cpu = common.cpu_seconds(proc.pid) - before
                spy.wait(timeout=60)
        print(f"{args.shape}, {args.streams} streams, {'one connection per stream' if args.fresh else 'keep-alive'}: "
              f"{done} {dict(burst='rounds', agent='requests').get(args.shape, 'chunks')}, proxy CPU {cpu:.2f} s")
        report(raw, args.top)
    finally:
        sink.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
