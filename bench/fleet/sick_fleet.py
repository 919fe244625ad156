"""A sick replica costs users nothing: the fleet's common sicknesses, each on a fresh proxy, side by side.

    .venv/bin/python -m bench.fleet sick-fleet                          # this checkout
    .venv/bin/python -m bench.fleet sick-fleet --before /tmp/before     # and a checkout of the previous design, in the same run
    (git worktree add /tmp/before <commit>)

Simulated replicas of one model behind one route with `retries: 1` (this checkout's simulator for every
proxy), a fresh proxy for each case:

1. one of three answers 503 at once (a crashed engine behind a healthy port): 240 streams, 8 at a time,
   with `pick: fewest_in_flight` and with `predicted_ttft`: the requests it received, the clients that got an error;
2. one of three answers 429 with Retry-After: 5: 40 requests over the next 5 s: how many it received then;
3. one of two fails (503) for 8 s, then recovers; 2 clients for 60 s: its share of first attempts while failing,
   and when it serves its share again (its share of the requests over a 5 s window reaches 30%);
4. 8,000-token prompts on two healthy replicas that prefill them in 1.6 s, `first_token_deadline: 1.0`:
   10 requests, 2 at a time: TTFT, and how many were served by the replica they met first;
5. a route of one replica with a deadline, the replica's first token after 3 s (its headers at once):
   when the client has the headers;
6. three equal replicas, `predicted_ttft`, 150 non-streaming requests, 3 at a time: the share of each.
"""
from __future__ import annotations

import argparse
import asyncio
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

from proxy.demo import prompt_of  # noqa: E402
from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HEALTHY = {"error_status": 0, "retry_after": "", "stall_after": -1, "prefill_tps": 5000.0, "ttft_ms": -1.0, "prefill_queue": False}


class Fleet:
    """Three simulated replicas, made sick and well again by /sim/config."""

    def __init__(self, ports: list[int]) -> None:
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]

    def configure(self, index: int, **values: Any) -> None:
        httpx.post(f"{self.urls[index]}/sim/config", json=values).raise_for_status()

    def heal(self) -> None:
        for i in range(len(self.urls)):
            self.configure(i, **HEALTHY)

    def requests(self, index: int) -> int:
        return int(httpx.get(f"{self.urls[index]}/sim/stats").json()["requests"])


def routes(workdir: Path, names: dict[str, str], **route: Any) -> str:
    path = workdir / f"routes-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump({"upstreams": [{"name": n, "url": f"{u}/v1"} for n, u in names.items()],
                                    "routes": [{"models": ["sim-7b"], "upstreams": list(names), **route}]}))
    return str(path)


class Proxy:
    def __init__(self, src: str, routes_path: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ctx = process(serve_command(src, "serve", "--routes", routes_path, "--port", str(self.port),
                                         "--records-db", str(workdir / f"records-{self.port}.sqlite")), f"{self.url}/healthz")

    def __enter__(self) -> "Proxy":
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)

    def records(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/llmproxy/requests", params={"limit": 100000}, timeout=60).json()


def first(record: dict[str, Any]) -> str:
    """The replica a request met first (the previous design listed no attempt when there was one)."""
    return record["attempts"][0]["upstream"] if record.get("attempts") else record["upstream"]


def attempts_at(record: dict[str, Any], upstream: str) -> list[float]:
    """When (wall s) each attempt of the request on `upstream` started."""
    received = record["received_unix_ns"] / 1e9
    tried = record.get("attempts") or [{"upstream": record["upstream"], "offset_s": 0.0}]
    return [received + a["offset_s"] for a in tried if a["upstream"] == upstream]


async def streams(base: str, n: int, at_once: int, body: dict[str, Any], headers: dict[str, str] | None = None,
                  pace_s: float = 0.0) -> list[dict[str, Any]]:
    """n requests, `at_once` in flight (or one every `pace_s`); per request: status, TTFT, time to headers, content chunks."""
    out: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        async def one(i: int) -> None:
            if pace_s:
                await asyncio.sleep(i * pace_s)
            async with gate:
                began = time.perf_counter()
                result: dict[str, Any] = {"ttft": None, "chunks": 0}
                async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                    result["status"], result["headers_s"] = response.status_code, time.perf_counter() - began
                    async for line in response.aiter_lines():
                        if '"content":"' in line and '"content":""' not in line:
                            result["ttft"] = result["ttft"] or time.perf_counter() - began
                            result["chunks"] += 1
                out.append(result)

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def chat(tokens: int = 5, stream: bool = True, prompt: str = "hi") -> dict[str, Any]:
    return {"model": "sim-7b", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "stream": stream}


def fail_fast(src: str, fleet: Fleet, workdir: Path, pick: str) -> list[Any]:
    fleet.configure(2, error_status=503)
    names = {"sick": fleet.urls[2], "a": fleet.urls[0], "b": fleet.urls[1]}
    before = fleet.requests(2)
    with Proxy(src, routes(workdir, names, retries=1, pick=pick), workdir) as proxy:
        results = asyncio.run(streams(proxy.url, 240, 8, chat(), {"x-sim-ttft-ms": "50"}))
    reached = fleet.requests(2) - before
    errors = sum(1 for r in results if r["status"] != 200 or r["chunks"] != 5)
    return [f"one of three answers 503 at once, `{pick}`", f"it received {reached / 240:.0%} of 240 streams; {errors / 240:.0%} of clients got an error"]


def retry_after(src: str, fleet: Fleet, workdir: Path) -> list[Any]:
    fleet.configure(2, error_status=429, retry_after="5")
    names = {"busy": fleet.urls[2], "a": fleet.urls[0], "b": fleet.urls[1]}
    with Proxy(src, routes(workdir, names, retries=1), workdir) as proxy:
        results = asyncio.run(streams(proxy.url, 40, 4, chat(), {"x-sim-ttft-ms": "50"}, pace_s=0.125))
        records = proxy.records()
    starts = sorted(at for r in records for at in attempts_at(r, "busy"))
    quiet = sum(1 for at in starts if starts[0] < at < starts[0] + 5.0)
    errors = sum(1 for r in results if r["status"] != 200)
    return ["one of three answers 429 with Retry-After: 5", f"it received {quiet} of the next {sum(1 for r in records if r['received_unix_ns'] / 1e9 > starts[0])} "
            f"requests in the 5 s it asked for; {errors} clients got an error"]


def recovery(src: str, fleet: Fleet, workdir: Path, seconds: float) -> list[Any]:
    fleet.configure(1, error_status=503)
    names = {"flaky": fleet.urls[1], "a": fleet.urls[0]}
    with Proxy(src, routes(workdir, names, retries=1), workdir) as proxy:
        async def drive() -> list[dict[str, Any]]:
            task = asyncio.create_task(streams(proxy.url, int(seconds * 20), 2, chat(), {"x-sim-ttft-ms": "50"}, pace_s=0.05))
            await asyncio.sleep(8.0)
            await asyncio.to_thread(fleet.configure, 1, error_status=0)
            return await task

        began = time.time()
        results = asyncio.run(drive())
        records = proxy.records()
    healed = began + 8.0
    failing = [r for r in records if r["received_unix_ns"] / 1e9 < healed]
    share = sum(1 for r in failing if first(r) == "flaky") / max(1, len(failing))
    back = None
    for start in range(0, int(seconds) - 5):  # the first 5 s window after the recovery in which it serves 30%
        window = [r for r in records if healed + start <= r["received_unix_ns"] / 1e9 < healed + start + 5]
        if window and sum(1 for r in window if r["upstream"] == "flaky") >= 0.3 * len(window):
            back = start
            break
    errors = sum(1 for r in results if r["status"] != 200)
    return ["one of two fails for 8 s, then recovers", f"while failing it met {share:.0%} of requests first; "
            f"its share again {'after ' + str(back) + ' s' if back is not None else 'never, within ' + str(int(seconds - 8)) + ' s'}; {errors} errors"]


def long_prompts(src: str, fleet: Fleet, workdir: Path) -> list[Any]:
    names = {"a": fleet.urls[0], "b": fleet.urls[1]}
    with Proxy(src, routes(workdir, names, retries=1, first_token_deadline=1.0), workdir) as proxy:
        results = asyncio.run(streams(proxy.url, 10, 2, chat(3, prompt=prompt_of(8000))))
        records = proxy.records()
    moved = sum(1 for r in records if len(r.get("attempts") or []) > 1)
    ttft = statistics.median(r["ttft"] for r in results)
    return ["8,000-token prompts (prefill 1.6 s), deadline 1.0 s", f"TTFT p50 {ttft:.2f} s ({ttft / 1.6:.2f}x the replica's own); "
            f"{10 - moved} of 10 served by the replica they met first"]


def one_replica(src: str, fleet: Fleet, workdir: Path) -> list[Any]:
    with Proxy(src, routes(workdir, {"only": fleet.urls[0]}, retries=1, first_token_deadline=1.0), workdir) as proxy:
        results = asyncio.run(streams(proxy.url, 4, 4, chat(3), {"x-sim-ttft-ms": "3000"}))
    return ["a route of one replica, deadline 1 s, first token at 3 s", f"the client had the headers after {max(r['headers_s'] for r in results):.2f} s"]


def non_streaming(src: str, fleet: Fleet, workdir: Path) -> list[Any]:
    names = {"r0": fleet.urls[0], "r1": fleet.urls[1], "r2": fleet.urls[2]}
    with Proxy(src, routes(workdir, names, pick="predicted_ttft"), workdir) as proxy:
        asyncio.run(streams(proxy.url, 150, 3, chat(2, stream=False), {"x-sim-ttft-ms": "20"}))
        records = proxy.records()
    shares = [sum(1 for r in records if r["upstream"] == n) / max(1, len(records)) for n in names]
    return ["three equal replicas, `predicted_ttft`, non-streaming", "shares " + " / ".join(f"{s:.0%}" for s in shares)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="", help="a checkout of the previous design, run in the same session")
    parser.add_argument("--recovery-seconds", type=float, default=60.0)
    parser.add_argument("--only", default="", help="one case: fail_fast, retry_after, recovery, long_prompts, one_replica, non_streaming")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="llmproxy-sick-"))
    ports = [free_port() for _ in range(3)]
    versions = ([("before", args.before)] if args.before else []) + [("after", str(ROOT))]
    rows: list[list[Any]] = []
    with simulator(ports[0]), simulator(ports[1]), simulator(ports[2]):
        fleet = Fleet(ports)
        cases = [("fail_fast", lambda src: fail_fast(src, fleet, workdir, "fewest_in_flight")),
                 ("fail_fast", lambda src: fail_fast(src, fleet, workdir, "predicted_ttft")),
                 ("retry_after", lambda src: retry_after(src, fleet, workdir)), ("recovery", lambda src: recovery(src, fleet, workdir, args.recovery_seconds)),
                 ("long_prompts", lambda src: long_prompts(src, fleet, workdir)), ("one_replica", lambda src: one_replica(src, fleet, workdir)),
                 ("non_streaming", lambda src: non_streaming(src, fleet, workdir))]
        for name, case in cases:
            if args.only and name != args.only:
                continue
            row: list[Any] = []
            for _, src in versions:
                fleet.heal()
                what, result = case(src)
                row = row or [what]
                row.append(result)
            rows.append(row)
    print(f"command: .venv/bin/python -m bench.fleet sick-fleet{' --before ' + args.before if args.before else ''}{' --only ' + args.only if args.only else ''}")
    print(table(["what the fleet did", *[name for name, _ in versions]], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
