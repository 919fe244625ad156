"""Secrets, content, authentication, cardinality: nothing leaked, nothing unbounded."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from proxy.processes import free_port
from servers import ROOT, Process
from test_otlp import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CANARY_KEY = "sk-LEAKCANARY-7f3c9a1e2b"
CANARY_PROMPT = "PROMPT-CANARY-51d2e8"


def run_traffic(base: str, key: str = CANARY_KEY) -> None:
    c = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    messages = [{"role": "user", "content": f"please repeat {CANARY_PROMPT}"}]
    list(c.chat.completions.create(model="sim-7b", messages=messages, max_tokens=3, stream=True))
    c.chat.completions.create(model="sim-7b", messages=messages, max_tokens=3)
    c.completions.create(model="sim-7b", prompt=CANARY_PROMPT, max_tokens=2)
    for status in ("500", "429"):
        with pytest.raises(openai.APIStatusError):
            c.chat.completions.create(model="sim-7b", messages=messages, extra_headers={"x-sim-error-status": status})
    httpx.post(f"{base}/chat/completions", content=b"{broken " + CANARY_PROMPT.encode(),
               headers={"authorization": f"Bearer {key}", "x-api-key": key})
    # Every API's own key header, on its own paths: Anthropic (x-api-key), Azure (api-key), a path no API owns.
    origin = base.removesuffix("/v1")
    anthropic.Anthropic(base_url=origin, api_key=key, max_retries=0).messages.create(
        model="sim-7b", max_tokens=3, messages=messages, extra_headers={"x-api-key": key})  # type: ignore[arg-type]
    openai.AzureOpenAI(azure_endpoint=origin, api_key=key, api_version="2024-10-21", max_retries=0).chat.completions.create(
        model="sim-7b", messages=messages, max_tokens=2)
    httpx.get(f"{origin}/api/tags?key={CANARY_PROMPT}", headers={"x-goog-api-key": key, "api-key": key})


def test_no_credential_or_prompt_in_logs_metrics_spans_records_or_errors(sim, tmp_path):
    receiver = Receiver()
    port = free_port()
    log_file = tmp_path / "proxy.log"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100", "LLMPROXY_LOG_LEVEL": "debug",
           "LLMPROXY_LOG_REQUESTS": "true"}
    with open(log_file, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--upstream", f"{sim.url}/v1", "--port", str(port)],
                                cwd=ROOT, env={**__import__("os").environ, **env}, stdout=log, stderr=subprocess.STDOUT)
        try:
            from proxy.processes import wait_healthy

            wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
            run_traffic(f"http://127.0.0.1:{port}/v1")
            dead = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m", "messages": []},
                              headers={"authorization": f"Bearer {CANARY_KEY}", "x-sim-ttft-ms": "0"})
            exposed = [httpx.get(f"http://127.0.0.1:{port}/metrics").text,
                       httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests").text, dead.text]
            deadline = time.monotonic() + 10
            while len(receiver.spans()) < 20 and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=15)
            receiver.server.shutdown()
    logged = log_file.read_text(errors="replace")
    assert "llmproxy.requests" in logged or '"outcome"' in logged  # the request log really was on
    everything = "\n".join(exposed) + logged + b"".join(receiver.raw).decode("latin-1")
    assert receiver.raw and len(receiver.spans()) >= 20
    assert CANARY_KEY not in everything
    assert CANARY_PROMPT not in everything
    assert "Bearer" not in everything


def test_capture_content_is_opt_in_and_only_on_spans(sim, proxy_factory):
    server = proxy_factory(capture_content=True)
    run_traffic(server.v1)
    attributes = [dict(s.attributes) for s in server.exporter.get_finished_spans() if s.name.startswith("chat ")]
    assert any(CANARY_PROMPT in a.get("gen_ai.input.messages", "") for a in attributes)
    assert any(a.get("gen_ai.output.messages") for a in attributes)
    assert CANARY_PROMPT not in httpx.get(f"{server.url}/llmproxy/requests").text
    assert CANARY_PROMPT not in httpx.get(f"{server.url}/metrics").text


def test_proxy_authentication_is_distinct_from_the_upstream_key(sim, proxy_factory, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# client keys\nfile-key-2\n")
    server = proxy_factory(api_key="proxy-key-1", api_keys_file=str(keys_file))
    body = {"model": "sim-7b", "messages": [], "max_tokens": 1}
    assert httpx.post(f"{server.v1}/chat/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server.v1}/chat/completions", json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0).models.list()
    for key in ("proxy-key-1", "file-key-2"):
        assert httpx.post(f"{server.v1}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}).status_code == 200
        assert "authorization" not in sim.stats()["last_headers"]  # the proxy's key never goes upstream
    assert server.sample("llmproxy_requests_in_flight", {"upstream": server.settings.upstream_label}) == 0  # refusals never count
    keyed = proxy_factory(api_key="proxy-key-1", upstream_api_key="sk-upstream-9", upstream_api_key_env="X")
    httpx.post(f"{keyed.v1}/chat/completions", json=body, headers={"authorization": "Bearer proxy-key-1"})
    assert sim.stats()["last_headers"]["authorization"] == "Bearer sk-upstream-9"


def test_admin_endpoints_can_be_protected_or_moved(sim, proxy_factory):
    protected = proxy_factory(admin_key="admin-secret")
    assert httpx.get(f"{protected.url}/metrics").status_code == 401
    assert httpx.get(f"{protected.url}/llmproxy/requests").status_code == 401
    assert httpx.get(f"{protected.url}/metrics", headers={"authorization": "Bearer admin-secret"}).status_code == 200
    assert httpx.get(f"{protected.url}/healthz").status_code == 200
    port, admin_port = free_port(), free_port()
    proc = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--admin-port", str(admin_port)],
                   f"http://127.0.0.1:{port}/healthz")
    try:
        main = httpx.get(f"http://127.0.0.1:{port}/metrics")  # (relayed to the upstream, as any path the proxy does not serve)
        assert main.status_code == 404 or "llmproxy_" not in main.text, main.text[:200]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
        assert "llmproxy_requests_total" in httpx.get(f"http://127.0.0.1:{admin_port}/metrics").text
    finally:
        proc.stop()


def test_ten_thousand_model_names_keep_series_and_memory_bounded(sim):
    port = free_port()
    proc = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port), "--max-models", "100", "--tokenize", "false"],
                   f"http://127.0.0.1:{port}/healthz")

    def rss_mb() -> float:
        return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{proc.process.pid}/status").read()).group(1)) / 1024

    async def flood(names: range) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=30) as client:
            semaphore = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with semaphore:
                    r = await client.post("/embeddings", json={"model": f"attacker-model-{i}", "input": "x"})
                    assert r.status_code == 200

            await asyncio.gather(*(one(i) for i in names))

    try:
        asyncio.run(flood(range(1000)))  # warm up: allocator, pools
        before = rss_mb()
        asyncio.run(flood(range(1000, 10_000)))
        after = rss_mb()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        proc.stop()
    models = set(re.findall(r'model="([^"]*)"', text))
    assert len(models) <= 101 and "other" in models
    total = sum(float(v) for v in re.findall(r'^llmproxy_requests_total\{[^}]*\} (\S+)$', text, re.M))
    assert total == 10_000
    assert after - before < 15, f"RSS grew {after - before:.1f} MB over 9,000 new model names"
