"""Thousands of open streams through one proxy: what each costs, and whether any fails or waits.

    .venv/bin/python -m bench.scale streams-scale [--levels 256,1024,4096] [--workers-level 10000] [--tokens 30]

An upstream that answers every stream as a busy engine does (the simulator: first token after 1 s,
then one token a second, `--tokens` of them), a proxy with default flags (records in a temporary
SQLite file) and, per level, N streams opened over a few seconds (N / 800 s, at least 2) by a lean
client of raw sockets (the official SDKs cost more CPU per chunk than the proxy: at 10,000 streams
they would measure themselves). The last level runs with `--workers 2`. Per level:
- RSS per open stream: the proxy's RSS (all its processes) with every stream open, less before;
- CPU per relayed chunk: the proxy's CPU over the window in which every stream is decoding, less
  what it spends idle (its timers; measured for 2 s before the streams), over the chunks the client
  received in it;
- file descriptors at the plateau; failures (any stream not answered 200 and ended by [DONE]);
- the client's TTFT less the upstream's 1 s (what the proxy and this machine add), p50 / p99, and the
  TTFT the records hold beside the client's, with the p99 of each phase before the first token
  (where the added time went);
- from the records: how many were written, the `wait` (the proxy's own) and `network` phases' p99,
  and the worst error of a record's TTFT and decode rate against the schedule;
- from the scrape: llmproxy_requests_total, against the requests served.

Everything shares this 2-core machine: the upstream, the client and the proxy.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import harness as common  # noqa: E402

from proxy.processes import free_port  # noqa: E402

TTFT_S = 1.0
CONTENT = re.compile(rb'"content":"[^"]')  # a content delta (the role-only chunk's content is "")


class Stream(asyncio.Protocol):
    """One streamed chat completion read off a raw socket: the status, the first content chunk's
    arrival, the chunk arrival times and whether [DONE] came."""

    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self.request, self.done = request, done
        self.sent_ns = 0
        self.status = 0
        self.first_ns = 0
        self.chunks: list[int] = []
        self.ended = False
        self.head = b""

    def connection_made(self, transport: Any) -> None:
        self.sent_ns = time.monotonic_ns()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        if not self.status:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return
            head, _, data = self.head.partition(b"\r\n\r\n")
            self.status = int(head.split(b" ", 2)[1])
            self.head = b""
        if CONTENT.search(data):
            if not self.first_ns:
                self.first_ns = now
            self.chunks.append(now)
        if b"data: [DONE]" in data:
            self.ended = True

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def open_streams(port: int, n: int, ramp_s: float, tokens: int) -> list[Stream]:
    loop = asyncio.get_running_loop()
    body = (b'{"model":"sim-7b","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"hi"}]}' % tokens)
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"x-sim-ttft-ms: %d\r\nx-sim-decode-tps: 1\r\nContent-Length: %d\r\n\r\n" % (int(TTFT_S * 1000), len(body))) + body
    streams: list[Stream] = []
    waits = []
    began = loop.time()
    for i in range(n):
        await asyncio.sleep(max(0.0, began + i * ramp_s / n - loop.time()))
        done: asyncio.Future[None] = loop.create_future()
        stream = Stream(request, done)
        try:
            await loop.create_connection(lambda s=stream: s, "127.0.0.1", port)
        except OSError:
            done.set_result(None)
        streams.append(stream)
        waits.append(done)
    await asyncio.wait_for(asyncio.gather(*waits), timeout=ramp_s + TTFT_S + tokens + 120)
    return streams


def proxy_pids(pid: int) -> list[int]:
    """The proxy and every process below it (its workers, their offload workers)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid, *(q for p in out for q in proxy_pids(int(p)))]


def sample(pids: list[int]) -> tuple[float, float, int]:
    """(RSS MiB, CPU seconds, descriptors) summed over the processes."""
    return (sum(common.memory_mb(p) for p in pids), sum(common.process_cpu_seconds(p) for p in pids),
            sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids))


def level(n: int, workers: int, tokens: int, sim_port: int) -> dict[str, Any]:
    import httpx

    port = free_port()
    folder = tempfile.mkdtemp(prefix="llmproxy-streams-")
    command = [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1", "--port", str(port),
               "--records-db", os.path.join(folder, "records.sqlite"), "--workers", str(workers)]
    ramp_s = max(2.0, n / 800)
    with common.process(command, f"http://127.0.0.1:{port}/healthz") as proc:
        time.sleep(1.0 if workers == 1 else 3.0)
        pids = proxy_pids(proc.pid)
        rss0, idle0, fds0 = sample(pids)
        time.sleep(2.0)
        idle_rate = (sample(pids)[1] - idle0) / 2.0  # CPU s/s of an idle proxy (its timers, the workers' samplers): not the chunks'

        marks: dict[str, tuple[float, float, int, int]] = {}  # (RSS, CPU, descriptors, when)

        async def drive() -> list[Stream]:
            loop = asyncio.get_running_loop()
            start = loop.time()
            window = (ramp_s + TTFT_S + 1.5, TTFT_S + tokens - 1.0)  # every stream decoding: all opened and past TTFT, none ended

            def mark(name: str) -> None:
                marks[name] = (*sample(pids), time.monotonic_ns())

            loop.call_at(start + window[0], mark, "from")
            loop.call_at(start + window[1], mark, "to")
            return await open_streams(port, n, ramp_s, tokens)

        import uvloop

        streams = uvloop.run(drive())
        time.sleep(2.0)  # the records' last batch
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            records = client.get("/llmproxy/requests", params={"limit": n + 100}).json()
            scrape = client.get("/metrics").text
    served = sum(float(v) for v in re.findall(r'^llmproxy_requests_total\{[^}]*\} ([0-9.e+]+)$', scrape, re.M))
    failed = sum(1 for s in streams if s.status != 200 or not s.ended)
    added = [(s.first_ns - s.sent_ns) / 1e9 - TTFT_S for s in streams if s.first_ns]
    window_ns = (marks["from"][3], marks["to"][3])
    chunks = sum(1 for s in streams for c in s.chunks if window_ns[0] <= c < window_ns[1])
    cpu = marks["to"][1] - marks["from"][1] - idle_rate * (window_ns[1] - window_ns[0]) / 1e9
    ok = [r for r in records if r["outcome"] == "ok"]
    ttft_err = max((abs(r["ttft_s"] - TTFT_S) for r in ok), default=float("nan"))
    rate_err = max((abs(r["decode_tokens_per_second"] - 1.0) for r in ok if r.get("decode_tokens_per_second")), default=float("nan"))
    phases = lambda name: [r["phases_s"].get(name, 0.0) for r in ok]  # noqa: E731
    client_ttft = [(s.first_ns - s.sent_ns) / 1e9 for s in streams if s.first_ns]
    record_ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    split = {name: common.pct(phases(name), 0.99) * 1000 for name in ("client", "proxy", "wait", "network", "prefill")}
    return {"streams": n, "workers": workers, "rss_per_stream_kb": (marks["from"][0] - rss0) * 1024 / n,
            "cpu_per_chunk_us": cpu / max(1, chunks) * 1e6, "chunks_in_window": chunks, "fds": marks["from"][2], "fds_before": fds0,
            "failed": failed, "added_ttft_p50_ms": statistics.median(added) * 1000 if added else float("nan"),
            "added_ttft_p99_ms": common.pct(added, 0.99) * 1000, "records": len(records), "records_ok": len(ok),
            "wait_p99_ms": common.pct(phases("wait"), 0.99) * 1000, "network_p99_ms": common.pct(phases("network"), 0.99) * 1000,
            "ttft_error_max_ms": ttft_err * 1000, "decode_tps_error_max": rate_err, "scraped_requests": served,
            "with_decode_rate": sum(1 for r in ok if r.get("decode_tokens_per_second")), "idle_cpu_per_s": idle_rate,
            "ttft_p50_p99_ms": {"client": (statistics.median(client_ttft) * 1000, common.pct(client_ttft, 0.99) * 1000),
                                "record": (statistics.median(record_ttft) * 1000, common.pct(record_ttft, 0.99) * 1000)},
            "phase_p99_ms": split}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="256,1024,4096", help="open streams through one process (default flags)")
    parser.add_argument("--workers-level", type=int, default=10_000, help="open streams with --workers 2 (0: none)")
    parser.add_argument("--tokens", type=int, default=30, help="tokens per stream, one a second")
    args = parser.parse_args()
    print(f"command: .venv/bin/python -m bench.scale streams-scale --levels {args.levels} --workers-level {args.workers_level} --tokens {args.tokens}\n")
    sim_port = free_port()
    plan = [(int(n), 1) for n in args.levels.split(",") if n] + ([(args.workers_level, 2)] if args.workers_level else [])
    rows, splits = [], []
    with common.simulator(sim_port):
        for n, workers in plan:
            r = level(n, workers, args.tokens, sim_port)
            print(r, flush=True)
            rows.append([f"{n:,}" + (" (--workers 2)" if workers > 1 else ""), f"{r['rss_per_stream_kb']:.1f} KB", f"{r['cpu_per_chunk_us']:.0f} µs",
                         f"{r['fds']:,}", r["failed"], f"{r['added_ttft_p50_ms']:.1f} / {r['added_ttft_p99_ms']:.1f} ms",
                         f"{r['wait_p99_ms']:.1f} ms", f"{r['network_p99_ms']:.1f} ms", f"{r['records']:,} ({r['records_ok']:,} ok)",
                         f"{r['scraped_requests']:,.0f}", f"{r['ttft_error_max_ms']:.1f} ms / {r['decode_tps_error_max']:.3f}"])
            (c50, c99), (r50, r99) = r["ttft_p50_p99_ms"]["client"], r["ttft_p50_p99_ms"]["record"]
            splits.append([f"{n:,}", f"{c50:.0f} / {c99:.0f} ms", f"{r50:.0f} / {r99:.0f} ms",
                           ", ".join(f"{v:.1f}" for v in r["phase_p99_ms"].values()) + " ms"])
    print()
    print(common.table(["open streams", "RSS per stream", "CPU per chunk", "descriptors", "failed", "added TTFT p50 / p99", "`wait` p99",
                        "`network` p99", "records", "scraped requests", "worst record TTFT / decode tok/s error"], rows))
    print()
    print(common.table(["open streams", "TTFT p50 / p99, the client's", "TTFT p50 / p99, the records'", "p99 of the phases before the first token "
                        "(client, proxy, wait, network, prefill)"], splits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
