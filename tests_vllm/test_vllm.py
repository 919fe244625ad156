"""Real vLLM (CPU build) upstream: timings against vLLM's own metrics, exact usage, abort on
disconnect, and W3C trace context joining vLLM's request span to the proxy's trace.

Run with `make test-vllm` (not part of `make test`: vLLM is 3.5 GB and starts in about a minute).
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from servers import ROOT, ProxyServer
from proxy.demo import free_port, wait_healthy
from test_otlp import Receiver

VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
LINE = "    def handle(self, request, *args, **kwargs):\n        return self.process(request)\n"


class VLLM:
    def __init__(self, workdir: Path, receiver: Receiver) -> None:
        model = workdir / "tiny-hf"
        subprocess.run([VLLM_PYTHON, str(ROOT / "tests/engines/tiny_hf.py"), str(model)], check=True, capture_output=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
               "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}
        self.log_path = workdir / "vllm.log"
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny-llama",
             "--dtype", "bfloat16", "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(self.port),
             "--otlp-traces-endpoint", f"{receiver.url}/v1/traces", "--enable-log-requests",
             "--enable-per-request-metrics", "--enable-prompt-tokens-details"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_healthy(f"{self.url}/health", self.process, timeout=300)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        out: dict[str, float] = {}
        for m in re.finditer(r'^(vllm:\w+)(\{[^}]*\})? (\S+)$', text, re.M):
            key = m.group(1) + (f"[{r}]" if (r := re.search(r'finished_reason="(\w+)"', m.group(2) or "")) and (r := r.group(1)) else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
        return out

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    receiver = Receiver()
    engine = VLLM(tmp_path_factory.mktemp("vllm"), receiver)
    proxy = ProxyServer(f"{engine.url}/v1")
    try:
        yield {"engine": engine, "proxy": proxy, "receiver": receiver}
    finally:
        proxy.stop()
        engine.stop()
        receiver.server.shutdown()


def ask(proxy: ProxyServer, lines: int, tokens: int = 16, **extra: Any) -> list[Any]:
    c = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    prompt = f"# request {time.monotonic_ns()}\n" + LINE * lines  # fresh: no prefix-cache hit
    return list(c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=tokens, stream=True, temperature=0, **extra))


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_timings_agree_with_vllm_metrics_and_usage_is_exact(stack):
    engine, proxy = stack["engine"], stack["proxy"]
    ask(proxy, 1)  # warm-up
    rows = []
    for lines in (1, 20):
        before_records, before = len(proxy.records()), engine.metrics()
        for _ in range(20):
            ask(proxy, lines, 24)
        records = proxy.wait_records(before_records + 20)[before_records:]
        after = engine.metrics()
        n = delta(before, after, "vllm:time_to_first_token_seconds_count")
        assert n == 20
        vllm_ttft = delta(before, after, "vllm:time_to_first_token_seconds_sum") / n
        vllm_itl = delta(before, after, "vllm:inter_token_latency_seconds_sum") / delta(before, after, "vllm:inter_token_latency_seconds_count")
        vllm_prefill = delta(before, after, "vllm:request_prefill_time_seconds_sum") / n
        vllm_queue = delta(before, after, "vllm:request_queue_time_seconds_sum") / n
        proxy_ttft = statistics.mean(r["ttft_s"] for r in records)
        proxy_itl = statistics.mean(r["decode_s"] / (r["content_chunks"] - 1) for r in records)
        assert delta(before, after, "vllm:prompt_tokens_total") == sum(r["prompt_tokens"] for r in records)
        assert delta(before, after, "vllm:generation_tokens_total") == sum(r["completion_tokens"] for r in records) == 480
        assert all(r["token_source"] == "usage" for r in records)
        # The proxy sees vLLM's TTFT plus the network, its tokenizer and its own time: never less.
        assert proxy_ttft >= vllm_ttft
        assert proxy_ttft - vllm_ttft < max(0.030, 0.25 * vllm_ttft)
        assert proxy_itl == pytest.approx(vllm_itl, rel=0.25)
        rows.append((records[0]["prompt_tokens"], proxy_ttft, vllm_ttft, vllm_queue, vllm_prefill, proxy_itl, vllm_itl,
                     statistics.mean(r["phases_s"]["network"] + r["phases_s"]["tokenize"] + r["phases_s"]["proxy"] for r in records)))
    assert rows[1][1] > rows[0][1] and rows[1][2] > rows[0][2]
    print("\n| prompt tokens | proxy TTFT ms | vLLM TTFT ms | difference ms | of which network+tokenize+proxy ms | vLLM queue ms | vLLM prefill ms | proxy ITL ms | vLLM ITL ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p, pt, vt, vq, vp, pi, vi, own in rows:
        print(f"| {p} | {pt * 1e3:.2f} | {vt * 1e3:.2f} | {(pt - vt) * 1e3:.2f} | {own * 1e3:.2f} | {vq * 1e3:.2f} | {vp * 1e3:.2f} | {pi * 1e3:.3f} | {vi * 1e3:.3f} |")


def test_client_disconnect_aborts_the_vllm_request(stack):
    engine, proxy = stack["engine"], stack["proxy"]
    before = engine.metrics()
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": LINE}], "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, timeout=60) as r:
        seen = 0
        for part in r.iter_raw():
            seen += part.count(b'"content":')
            if seen >= 5:
                break
    left = time.monotonic()
    aborted = 0.0
    while time.monotonic() - left < 10 and not aborted:
        if "aborted." in engine.log_path.read_text(errors="ignore").split("\n")[-50:].__str__():
            aborted = time.monotonic() - left
        time.sleep(0.05)
    # vLLM counts client aborts in no metric: its request log says so, and generation stops.
    assert aborted, "vLLM did not log the abort"
    assert engine.metrics()["vllm:num_requests_running"] == 0
    generated = delta(before, engine.metrics(), "vllm:generation_tokens_total")
    time.sleep(0.5)
    assert delta(before, engine.metrics(), "vllm:generation_tokens_total") == generated < 2000
    assert proxy.last_record()["outcome"] == "client_disconnect"
    print(f"\nvLLM logged the abort {aborted * 1000:.0f} ms after the client left; {generated:.0f} of 2000 tokens generated")


def test_vllm_request_span_is_a_child_of_the_proxy_upstream_request(stack):
    proxy, receiver = stack["proxy"], stack["receiver"]
    exported = len([s for s in proxy.exporter.get_finished_spans() if s.name == "upstream.request"])
    ask(proxy, 1, 8)
    deadline = time.monotonic() + 5  # spans are built by the finisher task, just after the response
    while len(spans := [s for s in proxy.exporter.get_finished_spans() if s.name == "upstream.request"]) == exported:
        assert time.monotonic() < deadline, "the proxy exported no upstream.request span"
        time.sleep(0.02)
    upstream = spans[-1]
    trace_id = upstream.context.trace_id.to_bytes(16, "big")
    deadline = time.monotonic() + 20
    joined: list[Any] = []
    while not joined and time.monotonic() < deadline:
        joined = [span for _, span, _ in receiver.spans() if span.trace_id == trace_id]
        time.sleep(0.2)
    assert joined, "vLLM exported no span in the proxy's trace"
    request_span = joined[0]
    assert request_span.parent_span_id == upstream.context.span_id.to_bytes(8, "big")
    attrs = {a.key for a in request_span.attributes}
    print(f"\nvLLM span {request_span.name!r} joined trace {trace_id.hex()} under upstream.request; attributes: {sorted(attrs)}")


def test_per_request_metrics_split_queue_and_prefill_and_cached_tokens_are_read(stack):
    """vLLM's `metrics` object (--enable-per-request-metrics) joined per request, on the real engine."""
    proxy = stack["proxy"]
    c = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)
    prompt = f"# request {time.monotonic_ns()}\n" + LINE * 40
    records = []
    before = len(proxy.records())
    for i in range(2):  # the second time the prompt's prefix is in vLLM's cache
        list(c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True,
                                       temperature=0))
        records.append(proxy.wait_records(before + i + 1)[-1])
    for r in records:
        engine = r["engine"]
        assert engine["source"] == "vllm" and engine["prompt_s"] > 0 and engine["queue_s"] is not None
        assert r["phases_s"]["prefill"] == pytest.approx(min(engine["prompt_s"], r["phases_s"]["prefill"] + r["phases_s"]["queue"]))
        assert r["phases_s"]["queue"] >= 0
        assert sum(r["phases_s"].values()) == pytest.approx(r["duration_s"], abs=1e-6)
    assert records[0]["cached_prompt_tokens"] == 0
    first, second = records
    print(f"\nvLLM per-request metrics: engine prefill {first['engine']['prompt_s'] * 1e3:.2f} ms (queue {first['engine']['queue_s'] * 1e3:.3f} ms) "
          f"of proxy TTFT {first['ttft_s'] * 1e3:.2f} ms; phases {first['phases_s']}; second request: cached prompt tokens "
          f"{second['cached_prompt_tokens']} of {second['prompt_tokens']}, engine prefill {second['engine']['prompt_s'] * 1e3:.2f} ms, "
          f"prefill tok/s {second['prefill_tokens_per_second']}")


def test_responses_api_timings_agree_with_vllm_metrics(stack):
    """The same comparison as chat, through `responses.create(stream=True)`: vLLM's own TTFT and
    inter-token histograms over the same requests, and its generated-token counter."""
    engine, proxy = stack["engine"], stack["proxy"]
    c = openai.OpenAI(base_url=proxy.v1, api_key="sk-test", max_retries=0)

    def respond(tokens: int) -> list[Any]:
        prompt = f"# request {time.monotonic_ns()}\n" + LINE * 20
        return list(c.responses.create(model="tiny-llama", input=prompt, max_output_tokens=tokens, stream=True, temperature=0))

    respond(4)  # warm-up
    before_records, before = len(proxy.records()), engine.metrics()
    finals = [respond(24)[-1] for _ in range(10)]
    records = proxy.wait_records(before_records + 10)[before_records:]
    after = engine.metrics()
    assert all(f.type == "response.completed" for f in finals)
    assert all(r["endpoint"] == "responses" and r["outcome"] == "ok" and r["token_source"] == "usage" for r in records)
    n = delta(before, after, "vllm:time_to_first_token_seconds_count")
    assert n == 10
    assert delta(before, after, "vllm:generation_tokens_total") == sum(r["completion_tokens"] for r in records)
    assert [r["completion_tokens"] for r in records] == [f.response.usage.output_tokens for f in finals]
    vllm_ttft = delta(before, after, "vllm:time_to_first_token_seconds_sum") / n
    vllm_itl = delta(before, after, "vllm:inter_token_latency_seconds_sum") / delta(before, after, "vllm:inter_token_latency_seconds_count")
    proxy_ttft = statistics.mean(r["ttft_s"] for r in records)
    proxy_itl = statistics.mean(r["decode_s"] / (r["content_chunks"] - 1) for r in records)
    assert proxy_ttft >= vllm_ttft and proxy_ttft - vllm_ttft < max(0.030, 0.25 * vllm_ttft)
    assert proxy_itl == pytest.approx(vllm_itl, rel=0.25)
    print(f"\nResponses API, {records[0]['prompt_tokens']} prompt tokens: proxy TTFT {proxy_ttft * 1e3:.2f} ms vs vLLM {vllm_ttft * 1e3:.2f} ms; "
          f"ITL proxy {proxy_itl * 1e3:.3f} ms vs vLLM {vllm_itl * 1e3:.3f} ms")


def test_anthropic_messages_timings_agree_with_vllm_metrics(stack):
    """vLLM's own Anthropic endpoint (vllm/entrypoints/anthropic, `POST /v1/messages`) through the
    proxy with the official `anthropic` client: the same comparison as chat."""
    import anthropic

    engine, proxy = stack["engine"], stack["proxy"]
    c = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0)

    def message(tokens: int) -> Any:
        prompt = f"# request {time.monotonic_ns()}\n" + LINE * 20
        with c.messages.stream(model="tiny-llama", max_tokens=tokens, messages=[{"role": "user", "content": prompt}],
                               extra_body={"temperature": 0}) as s:
            return s.get_final_message()

    message(4)  # warm-up
    before_records, before = len(proxy.records()), engine.metrics()
    finals = [message(24) for _ in range(10)]
    records = proxy.wait_records(before_records + 10)[before_records:]
    after = engine.metrics()
    assert all(r["api"] == "anthropic" and r["endpoint"] == "messages" and r["outcome"] == "ok" for r in records)
    assert [r["completion_tokens"] for r in records] == [f.usage.output_tokens for f in finals]
    assert delta(before, after, "vllm:generation_tokens_total") == sum(r["completion_tokens"] for r in records)
    n = delta(before, after, "vllm:time_to_first_token_seconds_count")
    vllm_ttft = delta(before, after, "vllm:time_to_first_token_seconds_sum") / n
    proxy_ttft = statistics.mean(r["ttft_s"] for r in records)
    assert proxy_ttft >= vllm_ttft and proxy_ttft - vllm_ttft < max(0.030, 0.25 * vllm_ttft)
    print(f"\nAnthropic Messages, {records[0]['prompt_tokens']} prompt tokens: proxy TTFT {proxy_ttft * 1e3:.2f} ms vs vLLM {vllm_ttft * 1e3:.2f} ms")
