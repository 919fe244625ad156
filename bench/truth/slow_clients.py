"""200 slow clients at once: the read-ahead stays under its caps, and memory with it.

    .venv/bin/python -m bench.truth slow-clients [--clients 200] [--seconds 10] [-- proxy flags]

Each client asks for a stream of big events (64 KB each: logprobs-sized, `x-sim-event-bytes`) at 20
tok/s, far more than it reads (64 KB/s, a 64 KB receive buffer), so every stream wants more than
its 8 MiB read-ahead and all of them together more than the process's 128 MiB (the defaults):
reading pauses at the caps. Reported: the proxy's RSS before, at its peak and after the clients
leave, and the bytes read ahead (`llmproxy_read_ahead_bytes`) at its peak and after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import memory_mb, process, request, simulator, table  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = {"x-sim-ttft-ms": "10", "x-sim-decode-tps": "20", "x-sim-event-bytes": "65536"}  # 64 KB events at 20 tok/s


def read_ahead(base: str) -> float:
    return next((float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines()
                 if line.startswith("llmproxy_read_ahead_bytes ")), 0.0)


async def slow_client(port: int, seconds: float, rate_bps: float) -> int:
    body = json.dumps({"model": "sim-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request("/v1/chat/completions", body, SCHEDULE))
    got, began = 0, time.monotonic()
    while time.monotonic() - began < seconds:
        data = await loop.sock_recv(sock, 16384)
        if not data:
            break
        got += len(data)
        ahead = got / rate_bps - (time.monotonic() - began)
        if ahead > 0:
            await asyncio.sleep(ahead)
    sock.close()  # gone mid-stream: its read-ahead must be freed at once
    return got


async def run(port: int, clients: int, seconds: float, pid: int, base: str) -> dict[str, float]:
    peaks = {"rss": 0.0, "ahead": 0.0}
    tasks = [asyncio.create_task(slow_client(port, seconds, 64 * 1024)) for _ in range(clients)]

    async def scrapes() -> None:  # (a scrape of a busy proxy takes a while: apart from the RSS samples)
        while not all(task.done() for task in tasks):
            peaks["ahead"] = max(peaks["ahead"], await asyncio.to_thread(read_ahead, base))

    scraper = asyncio.create_task(scrapes())
    while not all(task.done() for task in tasks):
        peaks["rss"] = max(peaks["rss"], memory_mb(pid))
        await asyncio.sleep(0.1)
    await scraper
    received = sum(task.result() for task in tasks)
    return {"peak_rss": peaks["rss"], "peak_ahead": peaks["ahead"], "received_mb": received / 1e6}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("proxy_args", nargs="*")
    args = parser.parse_args()
    sim_port, port = free_port(), free_port()
    with simulator(sim_port):
        command = serve_command(str(ROOT), "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1", "--port", str(port), "--records-db", "",
                                *args.proxy_args)
        base = f"http://127.0.0.1:{port}"
        with process(command, f"{base}/healthz") as proxy:
            httpx.post(f"{base}/v1/chat/completions", json={"model": "sim-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5})
            before = memory_mb(proxy.pid)
            result = asyncio.run(run(port, args.clients, args.seconds, proxy.pid, base))
            time.sleep(2.0)
            after, ahead_after = memory_mb(proxy.pid), read_ahead(base)
    print(f"command: .venv/bin/python -m bench.truth slow-clients {' '.join(sys.argv[1:])}")
    print(f"{args.clients} slow clients for {args.seconds:g} s, {result['received_mb']:.0f} MB received in all")
    print(table(["", "RSS (MB)", "read ahead (MB)"], [
        ["before", f"{before:.0f}", 0],
        ["peak", f"{result['peak_rss']:.0f} (+{result['peak_rss'] - before:.0f})", f"{result['peak_ahead'] / 2**20:.0f}"],
        ["2 s after the clients left", f"{after:.0f}", f"{ahead_after / 2**20:.0f}"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
