"""Spike: the CPU an upstream HTTP client costs per streamed chunk, candidates side by side.

    .venv/bin/python -m pip install aiohttp   # (make bench does it)
    .venv/bin/python -m bench.relay clients

Each candidate reads the same simulator streams (TTFT 0, 100 tokens at 200 tok/s, one SSE event
per chunk) on uvloop, in this process, alone: N streams at once, repeated for a few seconds. The
figure is this process's CPU (user + system) divided by the chunks read, so it is what the proxy's
upstream side would cost, without the relay. Candidates: httpcore's pool (what the proxy used),
aiohttp's client (C parser), and the proxy's own `Connection` (an asyncio Protocol with httptools'
parser, proxy/upstream/connection.py), through `proxy.upstream.pool.Pool`.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import simulator  # noqa: E402

from proxy.config import Settings  # noqa: E402
from proxy.processes import free_port  # noqa: E402
from proxy.measure.timing import RequestTiming, now_ns  # noqa: E402
from proxy.upstream.pool import Pool  # noqa: E402

BODY = b'{"model":"sim-7b","messages":[{"role":"user","content":"hello"}],"max_tokens":100,"stream":true}'
Reader = Callable[[], Awaitable[int]]


def httpcore_reader(port: int) -> tuple[Reader, Callable[[], Awaitable[None]]]:
    import httpcore

    pool = httpcore.AsyncConnectionPool(max_connections=512)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = [(b"host", f"127.0.0.1:{port}".encode()), (b"content-type", b"application/json")]

    async def read() -> int:
        chunks = 0
        async with pool.stream("POST", url, headers=headers, content=BODY) as response:
            async for _ in response.aiter_stream():
                chunks += 1
        return chunks

    return read, pool.aclose


def aiohttp_reader(port: int) -> tuple[Reader, Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512), auto_decompress=False)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def read() -> int:
        chunks = 0
        async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as response:
            async for _ in response.content.iter_any():
                chunks += 1
        return chunks

    return read, session.close


def connection_reader(port: int) -> tuple[Reader, Callable[[], Awaitable[None]]]:
    upstream = Pool(Settings(upstream=f"http://127.0.0.1:{port}/v1", max_connections=512))
    headers = [(b"host", f"127.0.0.1:{port}".encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(BODY)).encode())]

    async def read() -> int:
        chunks = 0
        connection = await upstream.send("POST", b"/v1/chat/completions", headers, BODY, RequestTiming(received_ns=now_ns()))
        try:
            while await connection.read():
                chunks += 1
        finally:
            upstream.release(connection)
        return chunks

    async def close() -> None:
        upstream.close()

    return read, close


CANDIDATES = {"httpcore": httpcore_reader, "aiohttp": aiohttp_reader, "connection": connection_reader}


async def run(make: Callable[[int], tuple[Reader, Callable[[], Awaitable[None]]]], port: int, streams: int, seconds: float) -> dict[str, Any]:
    read, close = make(port)
    await asyncio.gather(*(read() for _ in range(streams)))  # warm: connections open, code loaded
    deadline = time.perf_counter() + seconds
    chunks = 0

    async def worker() -> None:
        nonlocal chunks
        while time.perf_counter() < deadline:
            n = await read()  # (not `chunks += await read()`: that reads `chunks` before the await)
            chunks += n

    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(streams)))
    used = time.process_time() - cpu
    await close()
    return {"chunks": chunks, "cpu_us_per_chunk": used / max(1, chunks) * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    args = parser.parse_args()
    port = free_port()
    results: dict[tuple[str, int], list[float]] = {}
    with simulator(port):
        import httpx

        httpx.post(f"http://127.0.0.1:{port}/sim/config", json={"ttft_ms": 0.0, "decode_tps": 200.0}).raise_for_status()
        for _ in range(args.rounds):  # interleaved rounds: drift on the machine hits every candidate
            for streams in args.streams:
                for name in args.candidates:
                    result = uvloop.run(run(CANDIDATES[name], port, streams, args.seconds))
                    results.setdefault((name, streams), []).append(result["cpu_us_per_chunk"])
    print(f"rounds: {args.rounds}, {args.seconds} s each; median over rounds of client CPU µs per chunk")
    print("| client | " + " | ".join(f"{s} stream{'s' if s > 1 else ''}" for s in args.streams) + " |")
    print("|---|" + "---|" * len(args.streams))
    for name in args.candidates:
        print(f"| {name} | " + " | ".join(f"{statistics.median(results[(name, s)]):.1f}" for s in args.streams) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
