"""Bursts of concurrent streams through the proxy, and what a process holds afterwards.

Shared by the overload tests (tests/test_overload.py), the soak's burst mode (bench/scale/soak.py) and
the admission benchmark (bench/fleet/overload.py). Descriptors and socket states are read from /proc,
so no `ss` is needed.
"""
from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai

TCP_CLOSE_WAIT = "08"  # the st column of /proc/net/tcp


def descriptors(pid: int) -> int:
    """Open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def close_wait(pid: int) -> int:
    """TCP sockets of the process in CLOSE-WAIT: the peer closed, the process did not."""
    inodes, count = socket_inodes(pid), 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as handle:
            for line in handle.readlines()[1:]:
                parts = line.split()
                count += parts[3] == TCP_CLOSE_WAIT and parts[9] in inodes
    return count


@dataclass
class BurstResult:
    """How each request of a burst ended: `statuses` by HTTP status, `codes` by error code
    (`proxy_overloaded`, `upstream_connect_error`, …), `transport` by exception name (no response)."""

    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    transport: collections.Counter[str] = field(default_factory=collections.Counter)
    retry_after: set[str] = field(default_factory=set)  # Retry-After values seen on 503s
    ttft_s: list[float] = field(default_factory=list)  # of the streams that succeeded
    rejected_after_s: list[float] = field(default_factory=list)  # how fast 503s came
    elapsed_s: float = 0.0


async def burst(base_url: str, n: int, max_tokens: int = 20, prompt: str = "hi", timeout: float = 120.0) -> BurstResult:
    """`n` streams at once with the official client (no retries), each read to its end."""
    result = BurstResult()
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10), timeout=timeout)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-burst", max_retries=0, http_client=http)

    async def one() -> None:
        start = time.perf_counter()
        try:
            stream = await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": prompt}],
                                                          stream=True, max_tokens=max_tokens)
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            result.statuses[200] += 1
            if first is not None:
                result.ttft_s.append(first)
        except openai.APIStatusError as exc:
            result.statuses[exc.status_code] += 1
            body = exc.body if isinstance(exc.body, dict) else {}
            result.codes[str(body.get("code", "?"))] += 1
            if exc.status_code == 503:
                result.retry_after.add(exc.response.headers.get("retry-after", ""))
                result.rejected_after_s.append(time.perf_counter() - start)
        except openai.APIError as exc:  # no response at all: reset, refused, timeout
            result.transport[type(exc).__name__] += 1

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one() for _ in range(n)))
    finally:
        result.elapsed_s = time.perf_counter() - start
        await client.close()
    return result


def run_burst(base_url: str, n: int, max_tokens: int = 20, prompt: str = "hi") -> BurstResult:
    return asyncio.run(burst(base_url, n, max_tokens, prompt))


class Peak:
    """The most descriptors a process held while the `with` block ran (sampled every 50 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.most = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.most = max(self.most, descriptors(self.pid))
            except OSError:
                return

    def __enter__(self) -> "Peak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def settle(pid: int, baseline: int, within: float, slack: int = 10) -> tuple[float | None, int, int]:
    """Poll until the process is back within `slack` descriptors of `baseline` with no CLOSE-WAIT.
    Returns (seconds it took or None, descriptors, CLOSE-WAIT sockets at the end)."""
    start = time.monotonic()
    while True:
        fds, waiting = descriptors(pid), close_wait(pid)
        if fds <= baseline + slack and waiting == 0:
            return time.monotonic() - start, fds, waiting
        if time.monotonic() - start > within:
            return None, fds, waiting
        time.sleep(0.25)


def main() -> int:
    """One burst against a proxy run from any checkout (`--src`, e.g. a worktree of an older commit),
    under an optional RLIMIT_NOFILE, in front of the simulator: how it ended and what was left open."""
    import argparse
    import resource
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from proxy.processes import free_port, serve_command, wait_healthy

    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=str(root), help="the checkout whose proxy runs (default: this one)")
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--nofile", type=int, default=0, help="RLIMIT_NOFILE (soft = hard) of the proxy alone")
    parser.add_argument("--upstream-keepalive", type=float, default=5.0, help="the simulator's idle keep-alive (large: never closes)")
    args = parser.parse_args()
    sim_port, port = free_port(), free_port()

    def limit() -> None:
        if args.nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))

    sim = subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "--port", str(sim_port), "--decode-tps", "50",
                            "--keep-alive-timeout", str(args.upstream_keepalive)], cwd=root, stderr=subprocess.DEVNULL)
    proxy = subprocess.Popen(serve_command(args.src, "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1", "--port", str(port)),
                             preexec_fn=limit, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{sim_port}/health", sim)
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proxy)
        time.sleep(1.5)
        baseline = descriptors(proxy.pid)
        with Peak(proxy.pid) as peak:
            result = run_burst(f"http://127.0.0.1:{port}/v1", args.streams, args.tokens)
        took, fds, waiting = settle(proxy.pid, baseline, within=10.0)
        print(f"command: .venv/bin/python -m bench.truth burst --src {args.src} --streams {args.streams} --tokens {args.tokens} "
              f"--nofile {args.nofile} --upstream-keepalive {args.upstream_keepalive:g}")
        print(f"statuses {dict(result.statuses)}, error codes {dict(result.codes)}, no HTTP answer {dict(result.transport)}")
        print(f"descriptors: idle baseline {baseline}, peak {peak.most}, "
              f"{'back within 10 after %.1f s' % took if took is not None else 'still %d ten seconds after' % fds}; CLOSE-WAIT {waiting}")
    finally:
        proxy.terminate()
        sim.terminate()
        proxy.wait()
        sim.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
