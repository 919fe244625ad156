"""Agent sessions keep their prefix cache: each pick side by side on one agent workload.

    .venv/bin/python -m bench.fleet prefix-affinity                       # 2 and 4 replicas, one and two proxies
    .venv/bin/python -m bench.fleet prefix-affinity --replicas 2 --sessions 8 --turns 8

Simulated replicas with a prefix cache (`--prefix-cache-tokens`, vLLM's automatic prefix caching as
simulator/cache.py has it) and one prefill at a time (`--prefill-queue`: a busy replica queues), 5,000
uncached prompt tokens/s, 100 tok/s decode. The workload: `--sessions` agent sessions of `--turns`
turns each, all at once; a session's prompt is one system prompt every session shares (3,000 tokens,
as one agent's), then the whole conversation so far (each turn adds a 1,500-token user or tool
message, and the answer of 20 tokens before it), resent every turn; between turns, tool time drawn
from 0.05-1 s (seeded: every pick gets the same workload). Measured at the client (TTFT: the first
content chunk) and at the replicas (`/sim/stats`: prompt and cached tokens):

- `fewest_in_flight` and `predicted_ttft`: one route over the replicas;
- reference: each session kept on one replica (session i on replica i mod n, by a route per replica):
  what perfect affinity gives;
- with two proxies, each turn through one of them at random (a balancer without session affinity;
  `--spread alternate`: in turn, the worst case for proxies that share nothing).

Per run: mean TTFT, the cache share of prompt tokens, the turns served by their previous turn's
replica, each replica's share of the requests, and the proxies' `llmproxy_prefix_predicted_tokens_total`
over `llmproxy_prefix_reported_tokens_total` (how right the index was).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import process, simulator, table  # noqa: E402

from proxy.simulator import sessions  # noqa: E402
from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def proxy(src: str, routes_path: str, workdir: Path) -> tuple[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return url, process(serve_command(src, "serve", "--routes", routes_path, "--port", str(port),
                                      "--records-db", str(workdir / f"records-{port}.sqlite")), f"{url}/healthz")


def prefix_counts(proxies: list[str]) -> tuple[float, float]:
    """(predicted, reported) prefix tokens over the proxies' /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"llmproxy_prefix_predicted_tokens_total": 0.0, "llmproxy_prefix_reported_tokens_total": 0.0}
    for p in proxies:
        for family in text_string_to_metric_families(httpx.get(f"{p}/metrics").text):
            for sample in family.samples:
                if sample.name in out:
                    out[sample.name] += sample.value
    return out["llmproxy_prefix_predicted_tokens_total"], out["llmproxy_prefix_reported_tokens_total"]


def run(src: str, urls: list[str], workdir: Path, pick: str, n_proxies: int, w: sessions.Workload, cache_tokens: int) -> dict[str, Any]:
    sessions.cold(urls, cache_tokens)  # a cold, empty cache for every run
    before = sessions.sim_stats(urls)
    path = workdir / f"routes-{pick}-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(sessions.routes(urls, "fewest_in_flight" if pick == "reference" else pick)))
    with contextlib.ExitStack() as stack:
        proxies = []
        for _ in range(n_proxies):
            url, ctx = proxy(src, str(path), workdir)
            stack.enter_context(ctx)
            proxies.append(url)
        ttfts = sessions.run(proxies, w, pinned=len(urls) if pick == "reference" else 0)
        time.sleep(0.5)  # the last records written
        records = [r for p in proxies for r in httpx.get(f"{p}/llmproxy/requests", params={"limit": 100000}, timeout=60).json()]
        predicted, reported = prefix_counts(proxies)
    stayed, per = sessions.placed(records)
    served = [per.get(f"r{i}", 0) for i in range(len(urls))]
    return {"ttft": statistics.fmean(ttfts), "cache": sessions.cache_share(before, sessions.sim_stats(urls)), "stayed": stayed,
            "shares": [s / max(1, sum(served)) for s in served], "predicted": predicted, "reported": reported, "n": len(ttfts)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3], help="each a workload (tool times, texts): the figures are medians")
    parser.add_argument("--cache-tokens", type=int, default=1_000_000, help="each replica's prefix cache")
    parser.add_argument("--picks", nargs="*", default=["fewest_in_flight", "predicted_ttft", "reference"])
    parser.add_argument("--proxies", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--spread", default="random", choices=["random", "alternate"],
                        help="with several proxies, each turn through one at random (a balancer without affinity) or in turn")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="llmproxy-prefix-"))
    rows: list[list[Any]] = []
    for n in args.replicas:
        ports = [free_port() for _ in range(n)]
        with contextlib.ExitStack() as stack:
            for p in ports:
                stack.enter_context(simulator(p, "--prefill-queue", "--prefix-cache-tokens", str(args.cache_tokens)))
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for n_proxies in args.proxies:
                runs = {pick: [run(str(ROOT), urls, workdir, pick, n_proxies, sessions.Workload(sessions=args.sessions, turns=args.turns, seed=seed, spread=args.spread),
                                   args.cache_tokens) for seed in args.seeds] for pick in args.picks}
                reference = runs.get("reference")
                for pick, results in runs.items():
                    med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
                    ratios = [r["ttft"] / ref["ttft"] for r, ref in zip(results, reference)] if reference else []
                    shares = [statistics.median(r["shares"][i] for r in results) for i in range(n)]
                    predicted, reported = sum(r["predicted"] for r in results), sum(r["reported"] for r in results)
                    rows.append([n, n_proxies, pick, f"{med('ttft'):.3f} s", f"{med('cache'):.2f}", f"{med('stayed'):.2f}",
                                 " / ".join(f"{s:.0%}" for s in shares) + f" (max {max(max(r['shares']) for r in results):.0%})",
                                 f"{predicted / reported:.2f}" if reported else "-",
                                 f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"])
    print(f"command: .venv/bin/python -m bench.fleet prefix-affinity --replicas {' '.join(map(str, args.replicas))} --sessions {args.sessions} "
          f"--turns {args.turns} --seeds {' '.join(map(str, args.seeds))} --cache-tokens {args.cache_tokens} --proxies {' '.join(map(str, args.proxies))} --spread {args.spread}")
    print(table(["replicas", "proxies", "pick", "mean TTFT (median of seeds)", "cache share of prompt tokens", "turns on their previous turn's replica",
                 "requests per replica (median; the most any one had)", "index predicted / reported", "TTFT vs reference (median; range)"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
