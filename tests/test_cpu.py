"""The proxy short of CPU: its records stay the engine's (the kernel's arrival stamps), its own delay is
the phase lag, and the throttling and the event loop's lag are in the scrape (measure/cpu.py, arrival.py)."""
from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from proxy.measure import cpu
from proxy.processes import free_port, wait_healthy

from servers import ROOT, Process, scraped

sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402

SCHEDULE = {"x-sim-ttft-ms": "300", "x-sim-decode-tps": "50"}
TOKENS = 40


def stream(port: int, tokens: int = TOKENS) -> None:
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=SCHEDULE, timeout=60) as response:
        assert response.status_code == 200
        for _ in response.iter_raw():
            pass


def records(port: int, n: int) -> list[dict]:
    deadline = time.monotonic() + 15
    while True:
        got = httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": n}, timeout=10).json()
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_a_proxy_stopped_most_of_the_time_books_its_delay_as_lag_and_the_engine_stays_true(sim):
    """SIGSTOP for 80 ms of every 100 (what a CPU quota does, to the serving process): bytes keep arriving in
    its sockets meanwhile. Prefill, decode and network are still the simulator's; the delay is the phase lag."""
    port = free_port()
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port)], f"http://127.0.0.1:{port}/healthz")
    stop = threading.Event()

    def throttle() -> None:
        while not stop.is_set():
            os.kill(proxy.process.pid, signal.SIGSTOP)
            time.sleep(0.08)
            os.kill(proxy.process.pid, signal.SIGCONT)
            time.sleep(0.02)

    try:
        stream(port, 5)  # (warm: its connection and the tokenizer)
        stopper = threading.Thread(target=throttle)
        stopper.start()
        try:
            stream(port, 150)  # (3 s: the loop's probe, two timers a second at random while a request is in flight, samples six stalls)
        finally:
            stop.set()
            stopper.join()
        delivered = sim.delivered()
        record = records(port, 2)[-1]
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics").text  # (one scrape: its count and buckets agree)
        lag_count = float(re.search(r"^llmproxy_event_loop_lag_seconds_count (\S+)$", scrape, re.M).group(1))  # type: ignore[union-attr]
        lag_fast = float(re.search(r'^llmproxy_event_loop_lag_seconds_bucket\{le="0.005"\} (\S+)$', scrape, re.M).group(1))  # type: ignore[union-attr]
    finally:
        proxy.stop()
    phases = record["phases_s"]
    rate = (150 - 1) / delivered.window_s()
    print(f"\nprefill {phases['prefill'] * 1e3:.1f} ms (simulator {delivered.ttft_s * 1e3:.1f}), network {phases['network'] * 1e3:.2f} ms, "
          f"lag {phases['lag'] * 1e3:.1f} ms, decode {record['decode_tokens_per_second']:.2f} tok/s (simulator {rate:.2f})")
    # Loop stamps would be up to 80 ms late on each: the first token's (prefill), the connect's (network), the last's.
    assert abs(phases["prefill"] - delivered.ttft_s) < 0.015, (phases, delivered)
    assert phases["network"] < 0.005
    assert record["decode_tokens_per_second"] == pytest.approx(rate, rel=0.03)
    assert 0.0 <= record["first_token_inferred_s"] < 0.1  # (read with later tokens: placed before them, never by more than a stall)
    assert phases["lag"] > 0.010  # the delay is named (a stop that lands on the proxy's own work mid-way is in its phase proxy)
    assert lag_fast < lag_count, re.findall(r"^llmproxy_event_loop_lag_seconds.*$", scrape, re.M)  # the loop's probe saw timers over 5 ms late


def test_cgroup_files_of_v1_and_v2_are_found_and_read(tmp_path):
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "kubepods" / "pod1").mkdir(parents=True)
    group = v1 / "cpu,cpuacct" / "kubepods" / "pod1"
    (group / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 300000000\n")
    (group / "cpu.cfs_quota_us").write_text("50000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cgroup1").write_text("5:memory:/kubepods/pod1\n3:cpu,cpuacct:/kubepods/pod1\n0::/\n")
    found = cpu.find(str(tmp_path / "cgroup1"), str(v1))
    assert found == cpu.Cgroup(group / "cpu.stat", v2=False)
    assert found.read() == {"periods": 10, "throttled_periods": 4, "throttled_seconds": 0.3, "limit_cores": 0.5}

    v2 = tmp_path / "v2"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "cpu.stat").write_text("usage_usec 9\nnr_periods 7\nnr_throttled 2\nthrottled_usec 250000\n")
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cgroup2").write_text("0::/pod\n")
    found = cpu.find(str(tmp_path / "cgroup2"), str(v2))
    assert found == cpu.Cgroup(v2 / "pod" / "cpu.stat", v2=True)
    assert found.read() == {"periods": 7, "throttled_periods": 2, "throttled_seconds": 0.25}  # (no quota: no limit)
    (tmp_path / "namespaced").write_text("0::/\n")  # a container's cgroup namespace: its root is the mount's
    (v2 / "cpu.stat").write_text("nr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")
    assert cpu.find(str(tmp_path / "namespaced"), str(v2)) == cpu.Cgroup(v2 / "cpu.stat", v2=True)
    assert cpu.find(str(tmp_path / "missing"), str(v2)) is None


def make_quota_group(quota_us: int) -> Path:
    """A real cgroup with a CPU quota (bench/harness.py); skips where this process may not make one."""
    try:
        return harness.cpu_cgroup(f"llmproxy-test-{os.getpid()}", quota_us)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup with a CPU quota here ({exc}): needs root and a writable cgroup fs")


def test_a_cpu_quota_is_in_the_scrape_and_the_records_stay_the_engines(sim):
    """The proxy and every process it starts in a cgroup of 10 ms per 100 ms: the scrape says it is throttled and
    its limit; 32 streams' decode stays the simulator's schedule; their delay is the phase lag."""
    group = make_quota_group(10_000)
    port = free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--upstream", f"{sim.url}/v1", "--port", str(port)]
    process = subprocess.Popen(["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *command], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", process, timeout=60)
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda _: stream(port), range(32)))
        got = [r for r in records(port, 32) if r["outcome"] == "ok"]
        base = f"http://127.0.0.1:{port}"
        throttled, limit = scraped(base, "llmproxy_process_cpu_throttled_periods_total"), scraped(base, "llmproxy_process_cpu_limit_cores")
    finally:
        process.terminate()
        process.wait(timeout=30)
        harness.remove_cgroup(group)
    rates = [r["decode_tokens_per_second"] for r in got]
    lags = [r["phases_s"]["lag"] for r in got]
    print(f"\nthrottled periods {throttled}, limit {limit} cores; decode p50 {statistics.median(rates):.2f} tok/s, "
          f"lag p50 {statistics.median(lags) * 1e3:.1f} ms")
    assert len(got) == 32 and throttled and throttled > 0 and limit == pytest.approx(0.1)
    assert statistics.median(rates) == pytest.approx(50.0, rel=0.03)
    assert statistics.median(lags) > 0.0
