"""The alert chain, end to end: real traffic → the proxies → Prometheus with the project's rules
(time-scaled from the one source, dashboards/generate.py) → Alertmanager (Debian's package) → a
webhook receiver here. Every alert that should fire does and then resolves; nothing else fires.

One run of about a minute, on one timeline (seconds from the start):
- model `slow-7b` decodes at 100 tok/s, then 10 tok/s from 28 s (its "yesterday", 28 s earlier in
  the scaled rules, was fast), then 100 again from 52 s: LLMDecodeSpeedLow and
  LLMDecodeSpeedDropped fire for it, and resolve;
- `ttft-7b` starts its streams after 6 s until 20 s: LLMTimeToFirstTokenHigh fires and resolves;
- `fast-7b` at 100 tok/s, and `client-7b` read by a slow client and by clients that leave mid-stream:
  none of the upstream alerts, for them or their upstream;
- a second proxy (`sim-flaky`) sees 30% upstream 500s until 24 s: LLMUpstreamErrorRateHigh;
- a third (`--max-in-flight 2`) is offered 6 streams at once until 16 s: LLMProxySaturated;
- a fourth is killed at 4 s and started again at 16 s: LLMProxyDown.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
import yaml

from dashboards_util import RULES
from proxy.processes import free_port, wait_healthy
from servers import Process, Prometheus, Simulator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dashboards"))
import generate  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEADLINE_S = 100.0  # the whole chain normally settles by about 70 s
UPSTREAM_ALERTS = {"LLMDecodeSpeedLow", "LLMDecodeSpeedDropped", "LLMTimeToFirstTokenHigh", "LLMUpstreamErrorRateHigh"}


class Receiver:
    """Alertmanager's webhook target: every notification, with when it came."""

    def __init__(self) -> None:
        self.notes: list[tuple[float, str, dict[str, str]]] = []  # (arrival, status, labels)
        self.annotations: dict[str, dict[str, str]] = {}  # the last seen per alert name
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with receiver.lock:
                    for alert in body["alerts"]:
                        receiver.notes.append((time.monotonic(), alert["status"], alert["labels"]))
                        receiver.annotations[alert["labels"]["alertname"]] = alert["annotations"]
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def seen(self, alert: str, status: str, **labels: str) -> list[float]:
        with self.lock:
            return [at for at, s, got in self.notes if s == status and got["alertname"] == alert
                    and all(got.get(k) == v for k, v in labels.items())]


class Alertmanager:
    def __init__(self, workdir: Path, webhook: str) -> None:
        exe = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        assert exe, "alertmanager missing: run `make test` (it installs Debian's prometheus-alertmanager package)"
        self.port = free_port()
        config = {"route": {"receiver": "test", "group_by": ["alertname", "model", "upstream", "instance", "slo", "severity"],
                            "group_wait": "0s", "group_interval": "1s", "repeat_interval": "1h"},
                  "receivers": [{"name": "test", "webhook_configs": [{"url": webhook, "send_resolved": True}]}]}
        (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            [exe, f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'am'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"http://127.0.0.1:{self.port}/-/ready", self.process, timeout=30)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=15)


def proxy(sim: Simulator, name: str, port: int, *flags: str) -> Process:
    return Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--upstream-name", name, *flags],
                   f"http://127.0.0.1:{port}/healthz")


def loop_until(stop: threading.Event, body: Callable[[float], None], t0: float) -> None:
    while not stop.is_set():
        try:
            body(time.monotonic() - t0)
        except (openai.APIError, httpx.HTTPError):
            time.sleep(0.1)  # an injected 500, a refused request, a proxy that is down: the alerts are the point
        time.sleep(0.01)


@contextmanager
def traffic(workers: list[Callable[[float], None]], t0: float) -> Iterator[None]:
    """Each worker looping in its own thread (`loop_until`) for as long as the block runs."""
    stop = threading.Event()
    threads = [threading.Thread(target=loop_until, args=(stop, work, t0), daemon=True) for work in workers]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=35)


def wait_until(settled: Callable[[], bool], t0: float, deadline_s: float) -> None:
    while time.monotonic() - t0 < deadline_s and not settled():
        time.sleep(0.5)


def stream(client: openai.OpenAI, model: str, tokens: int, headers: dict[str, str]) -> int:
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=tokens,
                                            stream=True, extra_headers=headers)
    return sum(1 for _ in chunks)


@pytest.fixture()
def chain(tmp_path: Path) -> Iterator[dict[str, Any]]:
    sim = Simulator("--jitter", "0.05")
    ports = {name: free_port() for name in ("main", "flaky", "small", "doomed")}
    started: dict[str, Process] = {}
    receiver = Receiver()
    am = prom = None
    try:
        flags = {"small": ("--max-in-flight", "2")}
        with ThreadPoolExecutor(len(ports)) as pool:  # (started side by side: each start is a second of imports)
            starts = {name: pool.submit(proxy, sim, f"sim-{name}", port, *flags.get(name, ())) for name, port in ports.items()}
            failed = [start.exception() for start in starts.values() if start.exception() is not None]
            started.update({name: start.result() for name, start in starts.items() if start.exception() is None})  # (all stopped below)
            if failed:
                raise failed[0]
        am = Alertmanager(tmp_path, receiver.url)
        rules = tmp_path / "rules.yml"
        rules.write_text(generate.scaled_rules(RULES.read_text()))
        prom = Prometheus(tmp_path, [f"127.0.0.1:{port}" for port in ports.values()], rules, alertmanager=f"127.0.0.1:{am.port}")
        yield {"sim": sim, "ports": ports, "proxies": started, "receiver": receiver, "prom": prom}
    finally:
        for each in started.values():
            each.stop()
        for part in (prom, am):
            if part is not None:
                part.stop()
        receiver.server.shutdown()
        sim.proc.stop()


def test_alerts_fire_and_resolve_from_real_traffic_and_only_those(chain):
    ports, sim, receiver = chain["ports"], chain["sim"], chain["receiver"]
    base = {name: f"http://127.0.0.1:{port}/v1" for name, port in ports.items()}
    instance = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    clients = {name: openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) for name, url in base.items()}
    # Start once Prometheus has scraped every proxy and a LLMProxyMetricsAbsent of its start-up (before
    # the first scrape; `for` scaled to seconds) has been notified resolved: a fresh machine's first
    # scrape may come late, and that notification then arrive after the traffic began.
    def started_up() -> bool:
        up = [r for r in chain["prom"].query("up")["result"] if r["value"][1] == "1"]
        return len(up) == len(ports) and (not receiver.seen("LLMProxyMetricsAbsent", "firing")
                                          or bool(receiver.seen("LLMProxyMetricsAbsent", "resolved")))

    began = time.monotonic()
    wait_until(started_up, began, 60.0)
    time.sleep(2.0)  # (two rule evaluations: a notification sent at the first scrape has arrived)
    wait_until(started_up, began, 60.0)
    t0 = time.monotonic()

    def slow_model(at: float) -> None:
        tps = "10" if 28 <= at < 52 else "100"
        stream(clients["main"], "slow-7b", 8, {"x-sim-decode-tps": tps, "x-sim-ttft-ms": "20"})

    def ttft_model(at: float) -> None:
        stream(clients["main"], "ttft-7b", 4, {"x-sim-ttft-ms": "6000" if at < 20 else "30"})

    def fast_model(at: float) -> None:
        stream(clients["main"], "fast-7b", 8, {"x-sim-ttft-ms": "20"})

    def slow_reader(at: float) -> None:  # reads one chunk every 60 ms of a 100 tok/s stream (the kernel buffers the rest)
        with httpx.stream("POST", f"{base['main']}/chat/completions", timeout=30,
                          json={"model": "client-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True},
                          headers={"x-sim-ttft-ms": "20"}) as response:
            for _ in response.iter_raw(64):
                time.sleep(0.06)

    def leaver(at: float) -> None:  # leaves after three chunks
        chunks = clients["main"].chat.completions.create(model="client-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                                         stream=True, extra_headers={"x-sim-ttft-ms": "20"})
        for i, _ in enumerate(chunks):
            if i == 2:
                chunks.close()
                break

    def flaky(at: float) -> None:
        failing = at < 24 and int(at * 10) % 10 < 3
        stream(clients["flaky"], "fast-7b", 4, {"x-sim-ttft-ms": "20", **({"x-sim-error-status": "500"} if failing else {})})

    def crowd(at: float) -> None:
        if at < 16:
            stream(clients["small"], "fast-7b", 50, {"x-sim-ttft-ms": "20"})
        else:
            time.sleep(0.2)

    workers = [slow_model, slow_model, ttft_model, ttft_model, ttft_model, fast_model, slow_reader, leaver, flaky, flaky, *[crowd] * 6]
    expected = {
        ("LLMDecodeSpeedLow", "model", "slow-7b"), ("LLMDecodeSpeedDropped", "model", "slow-7b"),
        ("LLMTimeToFirstTokenHigh", "model", "ttft-7b"), ("LLMUpstreamErrorRateHigh", "upstream", "sim-flaky"),
        ("LLMProxySaturated", "instance", instance["small"]), ("LLMProxyDown", "instance", instance["doomed"]),
    }
    doomed = chain["proxies"]["doomed"]
    with traffic(workers, t0):
        time.sleep(max(0.0, 4 - (time.monotonic() - t0)))
        doomed.stop()
        time.sleep(max(0.0, 16 - (time.monotonic() - t0)))
        chain["proxies"]["doomed"] = proxy(sim, "sim-doomed", ports["doomed"])
        wait_until(lambda: all(receiver.seen(alert, "resolved", **{key: value}) for alert, key, value in expected), t0, DEADLINE_S)
    elapsed = time.monotonic() - t0
    timeline = {f"{alert} {value}": [round(min(receiver.seen(alert, s, **{key: value}), default=t0 - 1) - t0, 1) for s in ("firing", "resolved")]
                for alert, key, value in expected}
    print(f"\nalert chain settled in {elapsed:.1f} s; first firing / resolved notification (s from start): {timeline}")
    for alert, key, value in expected:
        fired, resolved = receiver.seen(alert, "firing", **{key: value}), receiver.seen(alert, "resolved", **{key: value})
        assert fired and resolved and min(fired) < max(resolved), (alert, value, timeline)
    assert not receiver.seen("LLMDecodeSpeedLow", "firing", model="fast-7b") and not receiver.seen("LLMDecodeSpeedDropped", "firing", model="fast-7b")
    # A slow or leaving client is not the upstream's fault: no upstream alert for its model or for its upstream's errors.
    assert not [1 for alert in UPSTREAM_ALERTS if receiver.seen(alert, "firing", model="client-7b")]
    assert not receiver.seen("LLMUpstreamErrorRateHigh", "firing", upstream="sim-main")
    with receiver.lock:
        names = {labels["alertname"] for _, _, labels in receiver.notes}
    # Before the first scrape nothing is there: with `for` scaled to seconds, LLMProxyMetricsAbsent
    # may fire while Prometheus starts (as it would after 5 minutes unscraped). Only then.
    absent = receiver.seen("LLMProxyMetricsAbsent", "firing")
    assert all(at < t0 for at in absent) and (not absent or receiver.seen("LLMProxyMetricsAbsent", "resolved")), [a - t0 for a in absent]
    # (LLMProxyOverheadHigh is the proxy's own time, on a machine this test fills with 9 processes: not asserted either way.)
    assert names - {"LLMProxyOverheadHigh", "LLMProxyMetricsAbsent"} == {alert for alert, _, _ in expected}, names
    # Each notification carries what to look at first, with the alert's own labels filled in.
    drop = next(labels for _, s, labels in receiver.notes if labels["alertname"] == "LLMDecodeSpeedLow")
    assert drop["upstream"] == "sim-main" and drop["severity"] == "warning"
    first_look = receiver.annotations["LLMDecodeSpeedLow"]["first_look"]
    assert "explain --model slow-7b --since 1h" in first_look and "/ui?model=slow-7b&upstream=sim-main" in first_look, first_look


SLO_CHAIN = """
objectives:
  - name: fast-burn
    models: [burn-fast]
    ttft: 0.1
    target: 0.99
  - name: slow-burn
    models: [burn-slow]
    ttft: 0.1
    target: 0.99
  - name: healthy
    models: [burn-ok]
    ttft: 0.1
    target: 0.99
"""


def test_burn_rate_alerts_page_a_fast_burn_ticket_a_slow_one_and_leave_a_healthy_slo_quiet(tmp_path):
    """The rules `llm-latency-proxy rules --slo` generates, time-scaled (windows 5m..3d become 3..16 s),
    on Debian's Prometheus and Alertmanager, fed by a real proxy judging real traffic. The bad share
    of each model is built in, by count: 20% (burn 20: above the page's 14.4 and 6), 4% (burn 4:
    above the tickets' 3 and 1 only), 0.5% (burn 0.5). The fast burn stops at 10 s: its page resets."""
    slo_file = tmp_path / "slo.yaml"
    slo_file.write_text(SLO_CHAIN)
    generated = subprocess.run([sys.executable, "-m", "proxy", "rules", "--slo", str(slo_file)], capture_output=True, text=True,
                               timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert generated.returncode == 0, generated.stderr
    rules = tmp_path / "slo-rules.yml"
    rules.write_text(generate.scaled_rules(generated.stdout, generate.SLO_SCALED_WINDOWS))
    sim, receiver, started, am, prom = Simulator(), Receiver(), [], None, None
    port = free_port()
    try:
        started.append(proxy(sim, "sim-slo", port, "--slo", str(slo_file)))
        am = Alertmanager(tmp_path, receiver.url)
        prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"], rules, alertmanager=f"127.0.0.1:{am.port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        t0 = time.monotonic()

        def burn(model: str, every: int, until: float = 1e9) -> Callable[[float], None]:
            sent = [0]

            def one(at: float) -> None:
                sent[0] += 1
                slow = sent[0] % every == 0 and at < until  # the n-th, 2n-th, ...: a TTFT miss (150 ms against 100)
                stream(client, model, 2, {"x-sim-ttft-ms": "150" if slow else "5", "x-sim-decode-tps": "1000"})
            return one

        workers = [burn("burn-fast", 5, until=10), burn("burn-slow", 25), burn("burn-ok", 200)]
        with traffic(workers, t0):  # (at least 20 s: the healthy and the slow SLO watched over more than the longest window)
            wait_until(lambda: bool(receiver.seen("LLMSLOBudgetBurn", "resolved", slo="fast-burn", severity="page")
                                    and receiver.seen("LLMSLOBudgetBurn", "firing", slo="slow-burn", severity="ticket")
                                    and time.monotonic() - t0 > 20), t0, 50)
        with receiver.lock:
            notes = [(round(at - t0, 1), status, labels.get("slo"), labels.get("severity")) for at, status, labels in receiver.notes
                     if labels["alertname"] == "LLMSLOBudgetBurn"]
        print(f"\nburn-rate notifications (s from start, status, slo, severity): {notes}")
        assert receiver.seen("LLMSLOBudgetBurn", "firing", slo="fast-burn", severity="page"), notes
        assert receiver.seen("LLMSLOBudgetBurn", "resolved", slo="fast-burn", severity="page"), notes  # reset once it stopped
        assert receiver.seen("LLMSLOBudgetBurn", "firing", slo="slow-burn", severity="ticket"), notes
        assert not receiver.seen("LLMSLOBudgetBurn", "firing", slo="slow-burn", severity="page"), notes
        assert not receiver.seen("LLMSLOBudgetBurn", "firing", slo="healthy"), notes
        page = next(labels for _, s, labels in receiver.notes if labels.get("slo") == "fast-burn" and labels["severity"] == "page")
        assert page["objective"] == "99%"
        annotations = receiver.annotations["LLMSLOBudgetBurn"]  # the last notification's: who is spending the budget
        assert "ttft misses blamed on prefill 100%" in annotations["blame"], annotations
        assert "/ui?slo=" in annotations["first_look"] and "&verdict=miss" in annotations["first_look"]
    finally:
        for each in started:
            each.stop()
        for part in (prom, am):
            if part is not None:
                part.stop()
        receiver.server.shutdown()
        sim.proc.stop()
