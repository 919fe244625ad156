"""The records' numbers when the proxy itself is short of CPU: the proxy and every process it starts in a
cgroup with a CPU quota (a Kubernetes CPU limit), relaying streams of an upstream that notes when it
wrote each byte, against the same proxy with no quota.

    .venv/bin/python -m bench.truth quota [--streams 96] [--quota-ms 5] [--period-ms 100] [--tokens 100] [--src DIR] [-- proxy flags]

Needs root (it makes a cgroup: v1's cpu controller, or v2's cpu.max). The upstream (bench/harness.py's
instrumented one: TTFT 300 ms, then a token every 20 ms, 50 tokens/s) and the clients run outside the
cgroup; each request names its own model, so the upstream's log and the proxy's record of it pair up.
Reported against the engine's own schedule, per request:
- queue + prefill: the record's `prefill` phase, against the upstream's arrival -> first content write;
- the `network` phase (loopback: a connect and one request write);
- decode tok/s, against the upstream's own writes (first content -> last);
- the proxy's own time before the first token (phases lag + proxy's before and first-token parts),
  against what the client lost beyond the engine (its TTFT less the engine's).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
def throttled(group: Path) -> tuple[int, float]:
    """(periods throttled, seconds throttled) so far, from the group's cpu.stat."""
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    if "throttled_usec" in stat:
        return int(stat["nr_throttled"]), int(stat["throttled_usec"]) / 1e6
    return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e9


async def clients(port: int, n: int, tokens: int, prefix: str = "q") -> dict[str, tuple[float, list[float]]]:
    """One stream per client, all at once: model name -> (client's start, its content arrivals), perf_counter."""
    out: dict[str, tuple[float, list[float]]] = {}

    async def one(i: int) -> None:
        connection = common.Connection("127.0.0.1", port, "/v1", {})
        model = f"{prefix}{i}"
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": tokens}
        start, arrivals, status = await connection.stream(body)
        connection.close()
        if status == 200:
            out[model] = (start, arrivals)

    await asyncio.gather(*(one(i) for i in range(n)))
    return out


def run(group: Path, streams: int, tokens: int, extra: list[str], src: str = str(ROOT)) -> dict[str, list[float]]:
    up_port, port = free_port(), free_port()
    log = Path(tempfile.mkdtemp()) / "upstream.jsonl"
    upstream = common.start_upstream(up_port, log, tokens, 0.020, 0.300)
    try:
        base = serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{up_port}/v1", "--port", str(port),
                             "--records-db", str(Path(tempfile.mkdtemp()) / "r.sqlite"), *extra)
        command = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *base]
        with common.process(command, f"http://127.0.0.1:{port}/healthz"):
            asyncio.run(clients(port, 4, 5, "warm"))  # warm
            before = throttled(group)
            seen = asyncio.run(clients(port, streams, tokens))
            after = throttled(group)
            deadline = time.monotonic() + 60
            while True:
                records = httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": streams + 10}, timeout=30).json()
                if sum(1 for r in records if r["model"] in seen) >= len(seen) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    finally:
        upstream.terminate()
        upstream.wait()
    engine = {line["model"]: line for line in map(json.loads, log.read_text().splitlines())}
    out: dict[str, list[float]] = {k: [] for k in ("prefill", "engine_ttft", "network", "tps", "engine_tps", "own", "lost", "lag")}
    for r in records:
        e, c = engine.get(r["model"]), seen.get(r["model"])
        if e is None or c is None or not c[1] or r.get("decode_tokens_per_second") is None:
            continue
        writes = e["writes"]
        out["engine_ttft"].append((writes[0] - e["arrived"]) / 1e9)
        out["prefill"].append(r["phases_s"].get("queue", 0.0) + r["phases_s"].get("prefill", 0.0))
        out["network"].append(r["phases_s"].get("network", 0.0))
        out["tps"].append(r["decode_tokens_per_second"])
        out["engine_tps"].append((len(writes) - 1) / ((writes[-1] - writes[0]) / 1e9))
        parts = r["proxy_parts_s"]
        lag = r["phases_s"].get("lag", 0.0)
        out["lag"].append(lag)
        out["own"].append(lag + parts["before"] + parts["first_token"])
        out["lost"].append(c[1][0] - c[0] - (writes[0] - e["arrived"]) / 1e9)
    out["throttled"] = [after[0] - before[0], after[1] - before[1]]
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--quota-ms", type=float, default=5.0)
    parser.add_argument("--period-ms", type=float, default=100.0)
    parser.add_argument("--src", default=str(ROOT), help="the checkout to run (a `git worktree` built with pip install --target DIR)")
    parser.add_argument("proxy_args", nargs="*", help="extra flags for the proxy, after --")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root: it makes a cgroup", file=sys.stderr)
        return 2
    ms = lambda values, q: f"{common.pct(values, q) * 1e3:.1f}"  # noqa: E731
    rows = []
    for label, quota in (("no quota", -1), (f"quota {args.quota_ms:g} ms / {args.period_ms:g} ms", int(args.quota_ms * 1000))):
        group = common.cpu_cgroup(f"llmproxy-bench-{os.getpid()}", quota, int(args.period_ms * 1000))
        try:
            o = run(group, args.streams, args.tokens, args.proxy_args, args.src)
        finally:
            common.remove_cgroup(group)
        rows.append([label, len(o["tps"]),
                     f"{ms(o['prefill'], 0.5)} (engine {ms(o['engine_ttft'], 0.5)})",
                     ms(o["network"], 0.9),
                     " / ".join(f"{common.pct(o['tps'], q):.2f}" for q in (0.1, 0.5, 0.9)) + f" (engine {common.pct(o['engine_tps'], 0.5):.2f})",
                     f"{ms(o['own'], 0.5)} (lag {ms(o['lag'], 0.5)}) / {ms(o['lost'], 0.5)}",
                     f"{o['throttled'][0]:.0f}, {o['throttled'][1]:.1f} s"])
        print(f"{label} done", flush=True)
    print(f"\ncommand: .venv/bin/python -m bench.truth quota {' '.join(sys.argv[1:])}; {args.streams} streams at once, "
          f"{args.tokens} tokens each (TTFT 300 ms, 50 tok/s)")
    print(common.table(["proxy", "records", "queue+prefill p50 (ms)", "network p90 (ms)", "decode tok/s p10 / p50 / p90",
                        "proxy's own before 1st token / client's loss beyond engine, p50 (ms)", "throttled periods, time"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
