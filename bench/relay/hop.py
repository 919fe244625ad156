"""What one relay hop adds to TTFT, measured at both ends of the upstream, so the upstream's own
time (and its spread from run to run) is not in the figure.

    .venv/bin/python -m bench.relay hop                  # direct, Envoy, this proxy (defaults, + tracing)
    .venv/bin/python -m bench.relay hop --rounds 8 --burst 64
    .venv/bin/python -m bench.relay hop --systems direct envoy defaults before --before DIR --shapes keep-alive   # another checkout

The upstream is bench/harness.py's instrumented one (bench/truth/stamps.py's): a raw HTTP server in its own process that notes when each
request arrived (its body read whole) and when it began writing the first content chunk
(`time.monotonic_ns()`, one clock for every process). The client (bench/harness.py's lean `Connection`) notes when it
began (before the connect, on a new connection) and when the first content arrived. A request's
hop time = (arrival at the upstream − client start) + (first content at the client − the
upstream's write): the way there and the way back, without the upstream's TTFT. Direct is the floor
of the same two legs (the kernel, the client's own event loop); a system's *added* time is its hop
time less direct's. Shapes: sequential single requests; bursts of `--burst` requests started at
once, on kept connections (keep-alive) and on new ones (one connection each), `--rounds` times.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.harness import Connection, pct, start_upstream  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


async def requests(port: int, prefix: str, tag: str, shape: str, burst: int, rounds: int, sequential: int) -> list[tuple[str, int, int]]:
    """(model, client start ns, first content ns) per request."""
    out: list[tuple[str, int, int]] = []

    async def one(conn: Connection, model: str) -> None:
        start, arrivals, status = await conn.stream({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                                     "stream_options": {"include_usage": True}})
        if status == 200 and arrivals:
            out.append((model, int(start * 1e9), int(arrivals[0] * 1e9)))

    if shape == "sequential":
        conn = Connection("127.0.0.1", port, prefix, {})
        for i in range(sequential):
            await one(conn, f"{tag}-{i}")
        conn.close()
        return out
    conns = [Connection("127.0.0.1", port, prefix, {}) for _ in range(burst)]
    for r in range(rounds + 1):  # (round 0 opens the kept connections, and is not counted)
        await asyncio.gather(*(one(conn, f"{tag}-{r}-{i}" if r else f"warm-{tag}-{i}") for i, conn in enumerate(conns)))
        if shape == "fresh":
            for conn in conns:
                conn.close()
        await asyncio.sleep(0.3)
    for conn in conns:
        conn.close()
    return [row for row in out if not row[0].startswith("warm-")]


def hops(rows: list[tuple[str, int, int]], log: Path) -> list[float]:
    upstream = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        upstream[entry["model"]] = (entry["arrived"], entry["writes"][0])
    return [((arrived - start) + (first - write)) / 1e6 for model, start, first in rows if model in upstream
            for arrived, write in [upstream[model]]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument("--systems", nargs="+", default=["direct", "envoy", "defaults", "tracing"])
    parser.add_argument("--shapes", nargs="+", default=["sequential", "keep-alive", "fresh"])
    parser.add_argument("--before", default="", help="another checkout, run as the system 'before' (its defaults)")
    args = parser.parse_args()
    upstream_port = free_port()
    log = Path(tempfile.mkdtemp()) / "writes.jsonl"
    upstream = start_upstream(upstream_port, log, 3, 0.005, 0.030)
    sink = common.Sink()
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for system in args.systems:
            port = free_port()
            if system == "direct":
                target, context = upstream_port, None
            elif system == "envoy":
                target = port
                context = common.process(common.envoy_command(port, upstream_port), f"http://127.0.0.1:{port}/health")
            else:
                target = port
                cmd = serve_command(args.before if system == "before" else str(ROOT), "serve", "--upstream", f"http://127.0.0.1:{upstream_port}/v1", "--port", str(port))
                context = common.process(cmd, f"http://127.0.0.1:{port}/healthz",
                                          {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url} if system == "tracing" else {})
            if context is not None:
                context.__enter__()
            try:
                results[system] = {}
                for shape in args.shapes:
                    tag = f"{system}-{shape}"
                    print(f"[{system}] {shape}", flush=True)
                    rows = asyncio.run(requests(target, "/v1", tag, shape, args.burst, args.rounds, args.sequential))
                    time.sleep(0.5)  # the upstream's log is written as each stream ends
                    results[system][shape] = hops(rows, log)
            finally:
                if context is not None:
                    context.__exit__(None, None, None)
    finally:
        sink.close()
        upstream.terminate()
        upstream.wait(timeout=10)
    print("\n| system | shape | requests | hop p50 (ms) | hop p99 (ms) | added p50 / p99 (ms) | added ÷ Envoy's, p50 / p99 |\n|---|---|---|---|---|---|---|")
    for system, shapes in results.items():
        for shape, values in shapes.items():
            base = results.get("direct", {}).get(shape) or [0.0]
            added50, added99 = pct(values, 0.5) - pct(base, 0.5), pct(values, 0.99) - pct(base, 0.99)
            envoy = results.get("envoy", {}).get(shape)
            ratio = ""
            if envoy and system not in ("direct", "envoy"):
                e50, e99 = pct(envoy, 0.5) - pct(base, 0.5), pct(envoy, 0.99) - pct(base, 0.99)
                ratio = f"{added50 / e50:.2f}× / {added99 / e99:.2f}×" if e50 > 0 and e99 > 0 else ""
            print(f"| {system} | {shape} | {len(values)} | {pct(values, 0.5):.3f} | {pct(values, 0.99):.3f} | "
                  f"{added50:.3f} / {added99:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
