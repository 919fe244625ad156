"""Agent sessions as coding agents send them (Claude Code, Codex: ../shared/STREAMS.md): one system prompt
every session of the agent shares, then the whole conversation so far resent every turn, each turn adding
a user or tool message and the answer before it, tool time between turns. What `make demo` and
bench/fleet/prefix_affinity.py drive through the proxy to show placement that knows each replica's prefix
cache (prefix.py, picker.py); the simulator's cache (simulator/cache.py) answers them.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from . import WORDS


@dataclass(frozen=True)
class Workload:
    sessions: int = 8
    turns: int = 8
    system_tokens: int = 3000
    turn_tokens: int = 1500
    answer_tokens: int = 20
    tool_s: tuple[float, float] = (0.05, 1.0)
    seed: int = 1
    spread: str = "random"  # with several proxies: each turn through one at random (a balancer without affinity), or "alternate"


def text(rng: random.Random, tokens: int) -> str:
    """`tokens` tokens of text (each word one token), unique to its draw."""
    return "".join(rng.choice(WORDS) for _ in range(tokens))


async def session(client: httpx.AsyncClient, proxies: list[str], index: int, w: Workload, model: str) -> list[float]:
    """One agent session, each turn through one of the proxies (`w.spread`): its turns' TTFTs (s) at the client."""
    rng = random.Random(w.seed * 1000 + index)
    spread = random.Random(w.seed * 1000 + index + 500)
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(random.Random(w.seed), w.system_tokens)}]
    ttfts: list[float] = []
    for turn in range(w.turns):
        messages.append({"role": "user", "content": f"session {index} turn {turn}:" + text(rng, w.turn_tokens)})
        body = {"model": model, "messages": messages, "max_tokens": w.answer_tokens, "stream": True, "user": f"session-{index}"}
        began, ttft = time.perf_counter(), None
        proxy = proxies[turn % len(proxies)] if w.spread == "alternate" else spread.choice(proxies)
        async with client.stream("POST", f"{proxy}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if ttft is None and '"content":"' in line and '"content":""' not in line:
                    ttft = time.perf_counter() - began
        if ttft is None:
            raise RuntimeError(f"session {index} turn {turn}: no content")
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": f"answer {index}.{turn}" + text(rng, w.answer_tokens)})
        await asyncio.sleep(rng.uniform(*w.tool_s))  # the tool runs
    return ttfts


def run(proxies: list[str], w: Workload, model: str | None = None, pinned: int = 0) -> list[float]:
    """Every session at once; each turn's TTFT. `pinned` > 0: session i asks for model `pin-{i % pinned}` (a route per
    replica: each session kept on one replica, the reference), else `model`."""
    async def drive() -> list[list[float]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(session(client, proxies, i, w, f"pin-{i % pinned}" if pinned else model or "sim-7b")
                                          for i in range(w.sessions)))

    return [t for each in asyncio.run(drive()) for t in each]


def placed(records: list[dict[str, Any]]) -> tuple[float, dict[str, int]]:
    """(the share of turns served by their previous turn's replica, requests per replica) from the records."""
    by_session: dict[str, list[tuple[int, str]]] = {}
    for r in records:
        by_session.setdefault(str(r.get("user")), []).append((r["received_unix_ns"], r["upstream"]))
    stayed = moved = 0
    for seq in by_session.values():
        seq.sort()
        for (_, a), (_, b) in zip(seq, seq[1:]):
            stayed, moved = stayed + (a == b), moved + (a != b)
    per: dict[str, int] = {}
    for r in records:
        per[r["upstream"]] = per.get(r["upstream"], 0) + 1
    return stayed / max(1, stayed + moved), dict(sorted(per.items()))


def sim_stats(urls: list[str]) -> list[dict[str, Any]]:
    """Each simulated replica's /sim/stats (its prompt and cached tokens so far)."""
    return [httpx.get(f"{u}/sim/stats").json() for u in urls]


def cold(urls: list[str], cache_tokens: int) -> None:
    """Each simulated replica's prefix cache emptied (set again: a run starts cold)."""
    for u in urls:
        httpx.post(f"{u}/sim/config", json={"prefix_cache_tokens": cache_tokens}).raise_for_status()


def cache_share(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> float:
    """The share of prompt tokens the replicas served from their caches between two reads of their /sim/stats."""
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    return sum(a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before)) / max(1, prompt)


def routes(urls: list[str], pick: str) -> dict[str, Any]:
    """A routes file: model sim-7b over every replica by `pick`, and `pin-i` to replica i alone (the reference)."""
    names = [f"r{i}" for i in range(len(urls))]
    return {"upstreams": [{"name": n, "url": f"{u}/v1"} for n, u in zip(names, urls)],
            "routes": [{"models": ["sim-7b"], "upstreams": names, "pick": pick},
                       *({"models": [f"pin-{i}"], "upstreams": [n]} for i, n in enumerate(names))]}


def demo(workdir: str, w: Workload = Workload(sessions=4, turns=4, turn_tokens=1000, tool_s=(0.05, 0.3))) -> tuple[Callable[[], None], list[str]]:
    """`make demo`'s agent sessions: two simulated replicas with prefix caches, one proxy
    per pick, each session's turns measured: (what prints the table, the records databases for `explain`)."""
    import os

    import yaml
    from rich.console import Console
    from rich.table import Table

    from ..processes import free_port, started

    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    table = Table(title=f"Agent sessions on two replicas with prefix caches: {w.sessions} sessions x {w.turns} turns, "
                        f"{w.system_tokens:,} system tokens shared, +{w.turn_tokens:,} tokens a turn")
    for column in ("pick", "mean ttft", "cache share", "turns on their last replica", "requests per replica"):
        table.add_column(column, justify="right")
    dbs = []
    flags = ["--prefix-cache-tokens", "200000"]
    with started(["simulate", "--port", str(ports[0]), *flags], f"{urls[0]}/health"), \
         started(["simulate", "--port", str(ports[1]), *flags], f"{urls[1]}/health"):
        for pick in ("fewest_in_flight", "predicted_ttft"):
            cold(urls, 200000)
            path, port = os.path.join(workdir, f"routes-{pick}.yaml"), free_port()
            with open(path, "w", encoding="utf-8") as handle:
                yaml.safe_dump(routes(urls, pick), handle)
            dbs.append(db := os.path.join(workdir, f"records-{pick}.sqlite"))
            before = sim_stats(urls)
            proxy = f"http://127.0.0.1:{port}"
            with started(["serve", "--routes", path, "--port", str(port), "--records-db", db], f"{proxy}/healthz"):
                ttfts = run([proxy], w)
                records = httpx.get(f"{proxy}/llmproxy/requests", params={"limit": 1000}).json()
            stayed, per = placed(records)
            share = cache_share(before, sim_stats(urls))
            table.add_row(pick, f"{sum(ttfts) / len(ttfts) * 1000:.0f} ms", f"{share:.0%}", f"{stayed:.0%}",
                          " / ".join(f"{name} {n}" for name, n in per.items()))

    def show() -> None:
        Console(width=max(Console().width, 150)).print(table)
        print("predicted_ttft places each turn where the replica's cache holds its conversation (the proxy's prefix index, "
              "checked against the cached tokens the engine reports); fewest_in_flight spreads the turns, prefilled again.")

    return show, dbs
