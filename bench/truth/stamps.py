"""How late does the proxy stamp a chunk? The upstream's write → the proxy's stamp, per content chunk.

    .venv/bin/python -m bench.truth stamps                       # 1 and 16 streams, records and tracing on
    .venv/bin/python -m bench.truth stamps --before /tmp/before  # the same for another checkout, side by side
    .venv/bin/python -m bench.truth stamps -- --token-spans off  # proxy flags after --

The upstream is bench/harness.py's instrumented one, a raw HTTP server in its own process: per
request an SSE role chunk, then `--chunks` content chunks `--gap-ms` apart, each noted with
`time.monotonic_ns()` just before its `send` (and the request's arrival, its body read whole:
bench/relay/hop.py uses both). The proxy's stamps come from its own records (`received_unix_ns` and `content_offsets_ms`;
CLOCK_MONOTONIC is one clock for every process, the wall offset is read here). Each request has its
own model name, so a record is matched to its upstream writes exactly. A stamp can only be late
(the bytes exist once written): the delay is stamp − write, for the first content chunk (TTFT's
end) and for the later ones (decode), p50 / p99 / max over every request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.harness import Connection, start_upstream  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def wall_offset_ns() -> int:
    """time.time_ns() - time.monotonic_ns(): both clocks are the system's, the same in every process."""
    samples = []
    for _ in range(9):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        samples.append(w - (a + b) // 2)
    return int(statistics.median(samples))


async def drive(port: int, streams: int, requests: int, tag: str) -> None:
    async def worker(index: int) -> None:
        conn = Connection("127.0.0.1", port, "/v1", {})
        for k in range(requests):
            body = {"model": f"{tag}-{index}-{k}", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True}}
            await conn.stream(body)
        conn.close()

    await asyncio.gather(*(worker(i) for i in range(streams)))


def delays(records: list[dict[str, Any]], writes: dict[str, list[int]], offset: int) -> tuple[list[float], list[float]]:
    first: list[float] = []
    later: list[float] = []
    for record in records:
        truth = writes.get(record["model"])
        stamps = record.get("content_offsets_ms") or []
        if not truth or len(stamps) != len(truth):
            continue
        received = record["received_unix_ns"] - offset
        late = [(received + ms * 1e6 - w) / 1000 for ms, w in zip(stamps, truth)]  # µs
        first.append(late[0])
        later.extend(late[1:])
    return first, later


def run_queue(pid: int) -> tuple[float, float]:
    """(seconds runnable but waiting for a CPU, seconds on a CPU) of a process's main thread (the
    event loop's), from /proc/PID/task/PID/schedstat: what the kernel's scheduler, not the proxy's
    code, adds to a stamp's delay on a busy machine."""
    ran, waited, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return int(waited) / 1e9, int(ran) / 1e9


def run(src: str, label: str, args: argparse.Namespace, extra: list[str], sink: common.Sink) -> list[dict[str, Any]]:
    upstream_port, port = free_port(), free_port()
    log = Path(tempfile.mkdtemp()) / "writes.jsonl"
    upstream = start_upstream(upstream_port, log, args.chunks, args.gap_ms / 1000, args.ttft_ms / 1000)
    rows = []
    try:
        records_db = Path(tempfile.mkdtemp()) / "records.sqlite"
        cmd = serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{upstream_port}/v1", "--port", str(port),
                            "--records-db", str(records_db), *extra)
        with common.process(cmd, f"http://127.0.0.1:{port}/healthz", {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url}) as proc:
            asyncio.run(drive(port, 2, 3, "warm"))
            for streams in args.streams:
                tag = f"s{streams}"
                requests = max(2, args.requests // streams)
                waited, ran = run_queue(proc.pid)
                began = time.monotonic()
                asyncio.run(drive(port, streams, requests, tag))
                elapsed = time.monotonic() - began
                after = run_queue(proc.pid)
                waited, ran = after[0] - waited, after[1] - ran
                time.sleep(1.0)  # the finisher and the records writer catch up
                records = [r for r in httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": 5000}, timeout=30).json()
                           if r["model"].startswith(tag + "-")]
                writes = {}
                for line in log.read_text().splitlines():
                    entry = json.loads(line)
                    writes[entry["model"]] = entry["writes"]
                first, later = delays(records, writes, wall_offset_ns())
                rows.append({"system": label, "streams": streams, "requests": len(first),
                             "first_p50_us": common.pct(first, 0.5), "first_p99_us": common.pct(first, 0.99), "first_max_us": max(first, default=float("nan")),
                             "later_p50_us": common.pct(later, 0.5), "later_p99_us": common.pct(later, 0.99), "later_max_us": max(later, default=float("nan")),
                             # the event loop's thread: waiting for a CPU (runnable, not running), as a share of the run
                             "loop_runqueue_wait_pct": 100 * waited / elapsed, "loop_cpu_pct": 100 * ran / elapsed})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
    return rows


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=96, help="per stream count, spread over the streams")
    parser.add_argument("--chunks", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--ttft-ms", type=float, default=30.0)
    parser.add_argument("--before", default="", help="another checkout, run first, in the same run")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, alternating the systems")
    args = parser.parse_args(argv)
    sink = common.Sink()
    rows = []
    try:
        for _ in range(args.rounds):
            if args.before:
                rows += run(args.before, f"before ({args.before})", args, extra, sink)
            rows += run(str(ROOT), "this checkout", args, extra, sink)
    finally:
        sink.close()
    print("\n| system | streams | requests | first chunk p50 / p99 / max (µs) | later chunks p50 / p99 / max (µs) | loop thread: CPU / waiting for a CPU (% of the run) |"
          "\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['streams']} | {r['requests']} | {r['first_p50_us']:,.0f} / {r['first_p99_us']:,.0f} / {r['first_max_us']:,.0f} "
              f"| {r['later_p50_us']:,.0f} / {r['later_p99_us']:,.0f} / {r['later_max_us']:,.0f} | {r['loop_cpu_pct']:.1f} / {r['loop_runqueue_wait_pct']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
