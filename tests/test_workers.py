"""--workers 2: prometheus-client multiprocess mode adds every worker's traffic up."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from servers import Process
from proxy.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REQUESTS = 40


def test_two_workers_metrics_add_up(sim, tmp_path):
    port = free_port()
    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    (metrics_dir / "stale_counter.db").write_bytes(b"left over from a previous run")  # must be emptied
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--workers", "2"], f"http://127.0.0.1:{port}/healthz", env)
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}

    def one(_: int) -> int:
        # A new connection per request, so the kernel spreads them over both workers.
        with httpx.Client(timeout=30) as c:
            return c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body).status_code

    try:
        # Which worker accepts a connection is the kernel's choice: batches until both served some.
        sent = 0
        for _ in range(10):
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(one, range(REQUESTS))) == [200] * REQUESTS
            sent += REQUESTS
            pids = {m.group(1) for m in re.finditer(r"counter_(\d+)\.db", " ".join(p.name for p in metrics_dir.iterdir()))}
            if len(pids) == 2:
                break
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        proxy.stop()
    total = sum(float(v) for v in re.findall(r'^llmproxy_requests_total\{[^}]*outcome="ok"[^}]*\} (\S+)$', text, re.M))
    count = sum(float(v) for v in re.findall(r"^llmproxy_request_duration_seconds_count\{[^}]*\} (\S+)$", text, re.M))
    assert total == sent and count == sent
    assert len(pids) == 2, "both workers should have served traffic"
    assert not (metrics_dir / "stale_counter.db").exists()
