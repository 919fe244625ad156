"""Hostile bodies while ordinary streams run: do they stall the other streams, or grow the proxy?

A round starts `--streams` streams at once (TTFT 20 ms, then `--tokens` tokens at `--tps` tok/s: a
known gap) and measures every gap between content chunks at the client. In a "with" round, another
process sends, 0.3 s in, four bodies that are legal JSON an engine rejects cheaply (the simulator
answers them 400 before parsing them, as an engine refuses an over-long prompt): two completions
prompts of 450,000 token ids (0.9 and 1.8 MB), a chat of 60,000 empty messages (1.7 MB) and a
completions batch of 200,000 one-token prompts (1.0 MB), all at once. Targets, interleaved round by
round in one run: `direct` (the simulator alone: the floor, since the simulator and the clients share
the two cores), this checkout's proxy without routes, the same with a route of two replicas placed
by prefix cache (`pick: predicted_ttft`, which indexes every prompt), and with --before DIR both
proxies from another checkout. Reports the medians over the rounds of the gap p50, p99 and largest
gap, and each proxy's whole process tree's memory (RSS: the serving process, the records process, the
tokenizer worker) before the first hostile round and after the last (after a warm-up that includes a
legitimate 96 KB prompt, for which the tokenizer worker loads its BPE table: that is not the bodies').

    .venv/bin/python -m bench.truth hostile [--rounds 5] [--before DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import orjson

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.harness import Connection, pct, request, simulator, tree_mb  # noqa: E402

from proxy.processes import free_port, serve_command, started  # noqa: E402

REJECT = {"x-sim-error-status": "400"}


def bodies() -> list[tuple[str, bytes]]:
    """The four hostile bodies (path, bytes)."""
    rng = random.Random(7)
    small_ids = [rng.randrange(10) for _ in range(450_000)]
    large_ids = [rng.randrange(100, 1000) for _ in range(450_000)]
    return [("/v1/completions", orjson.dumps({"model": "sim-7b", "prompt": small_ids, "max_tokens": 1})),
            ("/v1/completions", orjson.dumps({"model": "sim-7b", "prompt": large_ids, "max_tokens": 1})),
            ("/v1/chat/completions", orjson.dumps({"model": "sim-7b", "messages": [{"role": "user", "content": ""}] * 60_000, "max_tokens": 1})),
            ("/v1/completions", orjson.dumps({"model": "sim-7b", "prompt": [[rng.randrange(10)] for _ in range(200_000)], "max_tokens": 1}))]


def send_hostile(port: int, delay: float, ready: Any, statuses: Any) -> None:
    """In its own process: the four bodies at once, `delay` s after `ready` is set."""
    payloads = [request(path, data, REJECT) for path, data in bodies()]

    async def one(data: bytes, i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        head = await reader.readuntil(b"\r\n\r\n")
        statuses[i] = int(head[9:12])
        writer.close()

    async def run() -> None:
        ready.set()
        await asyncio.sleep(delay)
        await asyncio.gather(*(one(data, i) for i, data in enumerate(payloads)))
    asyncio.run(run())


async def streams(port: int, n: int, tokens: int, tps: float) -> list[float]:
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    conns = [Connection("127.0.0.1", port, "/v1", {"x-sim-ttft-ms": "20", "x-sim-decode-tps": str(tps)}) for _ in range(n)]
    results = await asyncio.gather(*(c.stream(body) for c in conns))
    for c in conns:
        c.close()
    return [(b - a) * 1000 for _, arrivals, _ in results for a, b in zip(arrivals[1:], arrivals[2:])]


def round_(port: int, args: argparse.Namespace, hostile: bool) -> tuple[float, float, float]:
    helper = None
    if hostile:
        spawn = multiprocessing.get_context("spawn")
        ready, statuses = spawn.Event(), spawn.Array("i", 4)
        helper = spawn.Process(target=send_hostile, args=(port, 0.3, ready, statuses))
        helper.start()
        ready.wait(60)
    gaps = asyncio.run(streams(port, args.streams, args.tokens, args.tps))
    if helper is not None:
        helper.join(60)
        assert list(statuses) == [400] * 4, list(statuses)
    return pct(gaps, 0.5), pct(gaps, 0.99), max(gaps)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--tps", type=float, default=100.0)
    parser.add_argument("--before", default="", help="a checkout whose proxy is measured too (before/after)")
    args = parser.parse_args()
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    sim_port = free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    routes = os.path.join(tempfile.mkdtemp(prefix="hostile-"), "routes.yaml")
    with open(routes, "w") as f:
        f.write(f"upstreams:\n  - {{name: a, url: {sim}/v1}}\n  - {{name: b, url: {sim}/v1}}\n"
                "routes:\n  - {models: ['*'], upstreams: [a, b], pick: predicted_ttft}\n")
    checkouts = {"": here, **({" before": os.path.abspath(args.before)} if args.before else {})}
    targets: dict[str, tuple[int, str, list[str]]] = {"direct": (sim_port, "", [])}
    for suffix, src in checkouts.items():
        targets[f"proxy{suffix}"] = (free_port(), src, [])
        targets[f"proxy{suffix}, predicted_ttft route"] = (free_port(), src, ["--routes", routes])
    with contextlib.ExitStack() as stack:
        stack.enter_context(simulator(sim_port))
        pids = {}
        for name, (port, src, flags) in targets.items():
            if src:
                proc = stack.enter_context(started([], f"http://127.0.0.1:{port}/healthz", quiet=True, command=serve_command(
                    src, "serve", "--upstream", f"{sim}/v1", "--port", str(port), *flags)))
                pids[name] = proc.pid
        for name, (port, _, _) in targets.items():
            round_(port, argparse.Namespace(**{**vars(args), "tokens": 30}), False)  # warm-up
            # (a legitimate long prompt first: the tokenizer worker loads its BPE table, some 70 MB, for any such prompt)
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "sim-7b", "messages": [{"role": "user", "content": "hello there " * 8000}], "max_tokens": 2})
        time.sleep(2)
        before = {name: tree_mb(pid) for name, pid in pids.items()}
        rows: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
        for _ in range(args.rounds):
            for name, (port, _, _) in targets.items():
                for hostile in (False, True):
                    rows.setdefault((name, hostile), []).append(round_(port, args, hostile))
        time.sleep(2)
        after = {name: tree_mb(pid) for name, pid in pids.items()}
    print(f"{args.streams} streams at {args.tps:g} tok/s (gap {1000 / args.tps:g} ms), {args.tokens} tokens, {args.rounds} rounds per "
          "target, interleaved; with: the four hostile bodies at once, 0.3 s into the round")
    print("| target | hostile bodies | gap p50 ms | gap p99 ms | largest gap ms |\n|---|---|---|---|---|")
    for (name, hostile), values in rows.items():
        p50, p99, largest = (statistics.median(row[i] for row in values) for i in range(3))
        print(f"| {name} | {'with' if hostile else 'without'} | {p50:.2f} | {p99:.2f} | {largest:.1f} |")
    print("\n| target | worst largest gap with (ms) | process tree MB before | after | grown |\n|---|---|---|---|---|")
    for name in pids:
        worst = max(row[2] for row in rows[(name, True)])
        print(f"| {name} | {worst:.1f} | {before[name]:.0f} | {after[name]:.0f} | {after[name] - before[name]:+.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
