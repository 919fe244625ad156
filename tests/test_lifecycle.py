"""Process lifecycle: SIGTERM drains in-flight streams and refuses new connections; an OTLP
endpoint that refuses costs clients nothing; --workers N exports spans from every worker."""
from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from proxy.processes import free_port
from servers import Process
from test_otlp import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BODY = {"model": "sim-7b", "messages": [{"role": "user", "content": "x"}], "stream": True}


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(sim):
    port = free_port()
    proc = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--shutdown-grace", "10"], f"http://127.0.0.1:{port}/healthz")
    result: dict[str, object] = {}

    def long_stream() -> None:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={**BODY, "max_tokens": 20},
                          headers={"x-sim-decode-tps": "10", "x-sim-ttft-ms": "0"}, timeout=30) as r:
            result["body"] = b"".join(r.iter_raw())

    thread = threading.Thread(target=long_stream)
    thread.start()
    time.sleep(0.5)
    proc.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    thread.join(timeout=15)
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown, as a well-behaved service does
    assert proc.process.wait(timeout=15) in (0, -signal.SIGTERM)
    body = result["body"]
    assert isinstance(body, bytes) and body.count(b'"content":" ') == 20 and body.endswith(b"data: [DONE]\n\n")


def test_a_proxy_stopped_by_sigterm_leaves_nothing_in_its_temporary_folder(sim, tmp_path):
    """Its records process and tokenizer worker in use, then SIGTERM, as an orchestrator stops it: its temporary
    folder is empty again (the records writer's fork server once left its listener's folder there at every stop:
    uvicorn re-raises the signal after its shutdown, so no exit handler runs)."""
    port, temporary = free_port(), tmp_path / "tmp"
    temporary.mkdir()
    proc = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--records-db", str(tmp_path / "records.sqlite")],
                   f"http://127.0.0.1:{port}/healthz", {"TMPDIR": str(temporary)})
    try:
        long_prompt = {**BODY, "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 3}  # (counted by the worker)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=long_prompt, timeout=30).status_code == 200
        deadline = time.monotonic() + 20  # (its record is made once the worker counted the prompt; a read flushes the records process)
        while not httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", timeout=10).json():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.process.send_signal(signal.SIGTERM)
        assert proc.process.wait(timeout=15) in (0, -signal.SIGTERM)
    assert sorted(path.name for path in temporary.iterdir()) == []


def test_an_otlp_endpoint_that_refuses_costs_clients_nothing(sim):
    def ttfts(port: int) -> list[float]:
        out = []
        with httpx.Client(timeout=10) as client:
            for _ in range(30):
                start = time.perf_counter()
                with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={**BODY, "max_tokens": 2},
                                   headers={"x-sim-ttft-ms": "5"}) as r:
                    first = None
                    for part in r.iter_raw():
                        if first is None and b'"content":" ' in part:
                            first = time.perf_counter() - start
                    out.append(first)
        return sorted(out)

    healthy_port, dead_port = free_port(), free_port()
    healthy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(healthy_port)], f"http://127.0.0.1:{healthy_port}/healthz")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}", "OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    dead = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(dead_port)], f"http://127.0.0.1:{dead_port}/healthz", env)
    try:
        normal, refused = ttfts(healthy_port), ttfts(dead_port)
        deadline = time.monotonic() + 20
        errors = 0.0
        while errors < 1 and time.monotonic() < deadline:
            text = httpx.get(f"http://127.0.0.1:{dead_port}/metrics").text
            errors = float(re.search(r'llmproxy_telemetry_errors_total\{component="otlp_export"\} (\S+)', text).group(1))
            time.sleep(0.5)
    finally:
        healthy.stop()
        dead.stop()
    assert len(refused) == 30
    assert refused[15] - normal[15] < 0.010, (normal, refused)  # medians within 10 ms (noise on a shared 2-core machine)
    assert errors >= 1  # the failed exports were counted, not silent


def test_spans_come_from_every_worker(sim):
    receiver = Receiver()
    port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    proc = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--workers", "2"], f"http://127.0.0.1:{port}/healthz", env)
    try:
        def one(_: int) -> int:
            with httpx.Client(timeout=10) as client:  # a new connection each time, 8 at once: both workers get some
                return client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**BODY, "max_tokens": 5},
                                   headers={"x-sim-decode-tps": "50"}).status_code

        from concurrent.futures import ThreadPoolExecutor

        # Which worker accepts a connection is the kernel's choice: send batches until both have
        # served some (bounded), then check that every request's span arrived.
        sent, pids, servers = 0, set(), []
        for _ in range(10):
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(one, range(30))) == [200] * 30
            sent += 30
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                servers = [resource.get("process.pid") for name, _, resource in receiver.spans() if name == "chat sim-7b"]
                if len(servers) >= sent:
                    break
                time.sleep(0.2)
            pids = set(servers)
            if len(pids) == 2:
                break
    finally:
        proc.stop()
        receiver.server.shutdown()
    assert len(servers) == sent
    assert len(pids) == 2
