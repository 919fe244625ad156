"""One tenant's burst never takes another's share: fair admission per tenant, side by side.

    .venv/bin/python -m bench.fleet fairness                          # this checkout
    .venv/bin/python -m bench.fleet fairness --before /tmp/before     # and a checkout of the previous design, in the same run
    (git worktree add /tmp/before <commit>)

This checkout's simulator (no batching law: the engine never slows with load, so what moves is the
proxy's admission), each case on a fresh proxy with two tenants told apart by key (`--tenants`), the
official client with its default retries (2, after Retry-After):

1. the issue's case: `--max-in-flight 32`; `chat` keeps 4 streams in flight (4 users, one stream after
   another: 30 tokens at 100 tok/s, TTFT 50 ms) for 12 s; after 4 s `bulk` sends 200 streams at once
   (100 tokens at 50 tok/s: 2 s each). Reported: the requests each tenant had refused at the proxy
   (its records: every 503 it answered, retries included) and at the client (after the client's
   retries), chat's TTFT p50 in its records before and during the burst, bulk's answered streams.
2. weights 3:1 (this checkout only: the previous parser refuses `weight`), `--max-in-flight 16`,
   both tenants saturating (24 users each, one 0.5 s stream after another, 1 s after a refusal as Retry-After says)
   for 8 s, without and with `--admission-queue-s 2`: the split of the slots held (the proxy's
   `llmproxy_admission_in_flight`, sampled every 0.1 s), of the streams answered, and the longest wait.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import process, simulator, table  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402
from proxy.serve.tenants import fingerprint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"chat": "sk-bench-chat-0001", "bulk": "sk-bench-bulk-0002"}


def tenants_file(directory: str, weights: dict[str, float] | None = None) -> str:
    path = Path(directory) / "tenants.yaml"
    path.write_text("tenants:\n" + "".join(f"  - name: {name}\n    keys: ['{fingerprint(key)}']\n"
                                         + (f"    weight: {weights[name]}\n" if weights else "") for name, key in KEYS.items()))
    return str(path)


async def one_stream(client: openai.AsyncOpenAI, tokens: int, tps: int, ttft_ms: int = 50) -> float:
    """A streamed answer to its end; its TTFT at the client."""
    start = time.monotonic()
    first = 0.0
    response = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=tokens,
                                                    extra_headers={"x-sim-decode-tps": str(tps), "x-sim-ttft-ms": str(ttft_ms)})
    async for chunk in response:
        if not first and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - start
    return first


def records(url: str, tenant: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(50):  # (the writer flushes within a second)
        out = httpx.get(f"{url}/llmproxy/requests", params={"limit": 5000, "tenant": tenant}, timeout=30).json()
        time.sleep(0.2)
        again = httpx.get(f"{url}/llmproxy/requests", params={"limit": 5000, "tenant": tenant}, timeout=30).json()
        if len(again) == len(out):
            return out
    return out


async def burst_case(url: str) -> dict[str, Any]:
    chat = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["chat"], timeout=60)
    bulk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["bulk"], timeout=60)
    start = time.monotonic()
    chat_errors = 0

    async def chat_user() -> None:
        nonlocal chat_errors
        while time.monotonic() - start < 12.0:
            try:
                await one_stream(chat, 30, 100)
            except openai.APIStatusError:
                chat_errors += 1

    async def bulk_one() -> bool:
        try:
            await one_stream(bulk, 100, 50)
            return True
        except openai.APIStatusError:
            return False

    users = [asyncio.create_task(chat_user()) for _ in range(4)]
    await asyncio.sleep(4.0)
    burst_ns = time.time_ns()
    answered = sum(await asyncio.gather(*(bulk_one() for _ in range(200))))
    burst_end_ns = time.time_ns()
    await asyncio.gather(*users)
    await chat.close()
    await bulk.close()
    mine = records(url, "chat")
    before = [r["ttft_s"] for r in mine if r["outcome"] == "ok" and r["ttft_s"] is not None and r["received_unix_ns"] < burst_ns]
    during = [r["ttft_s"] for r in mine if r["outcome"] == "ok" and r["ttft_s"] is not None and burst_ns <= r["received_unix_ns"] < burst_end_ns]
    bulk_records = records(url, "bulk")
    return {"chat_requests": len(mine), "chat_refused": sum(r["outcome"] == "overloaded" for r in mine), "chat_errors": chat_errors,
            "ttft_before": statistics.median(before) if before else float("nan"),
            "ttft_during": statistics.median(during) if during else float("nan"),
            "bulk_answered": answered, "bulk_refused": sum(r["outcome"] == "overloaded" for r in bulk_records)}


async def weights_case(url: str) -> dict[str, Any]:
    clients = {name: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, timeout=60, max_retries=0) for name, key in KEYS.items()}
    answered = {name: 0 for name in KEYS}
    longest = 0.0
    start = time.monotonic()

    async def user(name: str) -> None:
        nonlocal longest
        while time.monotonic() - start < 8.0:
            asked = time.monotonic()
            try:
                ttft = await one_stream(clients[name], 25, 50, ttft_ms=0)
                if time.monotonic() - start > 1.0:  # (after the first second: both saturating)
                    answered[name] += 1
                longest = max(longest, ttft)
            except openai.APIStatusError:
                longest = max(longest, time.monotonic() - asked)
                await asyncio.sleep(1.0)  # (as Retry-After says)

    held: list[tuple[float, float]] = []

    async def sample() -> None:  # the slots each tenant holds, from the proxy's gauge, every 0.1 s after the first second
        async with httpx.AsyncClient() as scraper:
            await asyncio.sleep(1.0)
            while time.monotonic() - start < 7.5:
                text = (await scraper.get(f"{url}/metrics")).text
                values = dict(re.findall(r'^llmproxy_admission_in_flight\{tenant="(\w+)"\} (\S+)', text, re.M))
                held.append((float(values.get("chat", 0)), float(values.get("bulk", 0))))
                await asyncio.sleep(0.1)

    await asyncio.gather(sample(), *(user(name) for name in KEYS for _ in range(24)))
    for client in clients.values():
        await client.close()
    total = sum(answered.values()) or 1
    slots = sum(a for a, _ in held) / (sum(a + b for a, b in held) or 1)
    return {"chat_share": answered["chat"] / total, "answered": answered, "longest": longest, "slots": slots,
            "mean_held": (sum(a for a, _ in held) / len(held), sum(b for _, b in held) / len(held))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="", help="a checkout of the previous design, run in the same session")
    args = parser.parse_args()
    sim_port = free_port()
    versions = ([("before", args.before)] if args.before else []) + [("after", str(ROOT))]
    burst_rows, weight_rows = [], []
    with simulator(sim_port, "--decode-tps", "100"):
        upstream = f"http://127.0.0.1:{sim_port}/v1"
        for name, src in versions:
            with tempfile.TemporaryDirectory() as directory:
                port = free_port()
                command = serve_command(src, "serve", "--upstream", upstream, "--port", str(port), "--max-in-flight", "32",
                                        "--tenants", tenants_file(directory), "--records-db", f"{directory}/records.sqlite")
                with process(command, f"http://127.0.0.1:{port}/healthz"):
                    r = asyncio.run(burst_case(f"http://127.0.0.1:{port}"))
            burst_rows.append([name, f"{r['chat_requests']}", f"{r['chat_refused']} at the proxy, {r['chat_errors']} at the client",
                               f"{r['ttft_before'] * 1000:.1f} ms", f"{r['ttft_during'] * 1000:.1f} ms",
                               f"{r['bulk_answered']} of 200", f"{r['bulk_refused']}"])
            print(burst_rows[-1], flush=True)
        for queue in ("0", "2"):
            with tempfile.TemporaryDirectory() as directory:
                port = free_port()
                command = serve_command(str(ROOT), "serve", "--upstream", upstream, "--port", str(port), "--max-in-flight", "16",
                                        "--admission-queue-s", queue, "--tenants", tenants_file(directory, {"chat": 3, "bulk": 1}),
                                        "--records-db", f"{directory}/records.sqlite")
                with process(command, f"http://127.0.0.1:{port}/healthz"):
                    w = asyncio.run(weights_case(f"http://127.0.0.1:{port}"))
            weight_rows.append([f"--admission-queue-s {queue}", f"{w['slots']:.3f} ({w['mean_held'][0]:.1f} / {w['mean_held'][1]:.1f})",
                                f"{w['chat_share']:.3f}",
                                f"{w['answered']['chat']} / {w['answered']['bulk']}", f"{w['longest']:.2f} s"])
            print(weight_rows[-1], flush=True)
    print(f"command: .venv/bin/python -m bench.fleet fairness{' --before ' + args.before if args.before else ''}\n")
    print(table(["version", "chat requests", "chat refused", "chat TTFT p50 before the burst", "during it", "bulk answered",
                 "bulk refused at the proxy"], burst_rows))
    print()
    print(table(["weights 3:1, both saturating", "the weight-3 tenant's share of the slots held (mean held, 3 / 1)",
                 "its share of the streams answered", "answered (3 / 1)",
                 "longest wait or TTFT"], weight_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
