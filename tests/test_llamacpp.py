"""The real llama.cpp server upstream (prebuilt in the xllamacpp wheel) with a generated model."""
from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from servers import ROOT, ProxyServer
from engines.tap import Tap, http_body
from engines.tiny_llama import write as write_model
from proxy.processes import free_port, wait_healthy

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.engine]

# Python source lines: the tokenizer was trained on the standard library, so token counts are stable.
LINE = "    def handle(self, request, *args, **kwargs):\n        return self.process(request)\n"


class LlamaServer:
    def __init__(self, model: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, str(ROOT / "tests/engines/llama_server.py"), str(model), str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"{self.url}/health", self.process, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(llamacpp:\w+) (\S+)$", text, re.M)}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    model = write_model(tmp_path_factory.mktemp("model") / "tiny-llama.gguf")
    server = LlamaServer(model)
    yield server
    server.stop()


@pytest.fixture
def via(engine: LlamaServer) -> Iterator[ProxyServer]:
    server = ProxyServer(f"{engine.url}/v1")
    yield server
    server.stop()


def ask(server: ProxyServer, lines: int, tokens: int = 16, stream: bool = True, **extra: Any) -> list[Any] | Any:
    c = openai.OpenAI(base_url=server.v1, api_key="sk-test", max_retries=0)
    # A fresh first line each time: llama.cpp's prompt cache must not skip prefill.
    prompt = f"# request {time.monotonic_ns()}\n" + LINE * lines
    result = c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=tokens, stream=stream, temperature=0, **extra)
    return list(result) if stream else result


def test_openai_client_stream_and_non_stream(via):
    chunks = ask(via, 2)
    # The random tiny model's 16 tokens may end mid-UTF-8 character, which llama.cpp holds back
    # (several tokens in one chunk, or none): what holds is that every content chunk the client
    # got is one the proxy counted, and the engine generated 16 tokens.
    content = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    streamed = via.last_record()
    assert content >= 1 and streamed["content_chunks"] == content and streamed["engine"]["predicted_tokens"] == 16
    reply = ask(via, 2, stream=False)
    assert reply.usage.completion_tokens == 16 and reply.choices[0].message.content
    record = via.last_record()
    assert record["engine"]["source"] == "llama.cpp" and record["engine"]["predicted_tokens"] == 16
    assert record["completion_tokens"] == 16 and "queue" in record["phases_s"] and "server" not in record["phases_s"]


def test_the_byte_stream_is_unaltered(engine):
    tap = Tap(engine.port)
    server = ProxyServer(f"http://127.0.0.1:{tap.port}/v1", inject_usage=False)
    try:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": LINE}], "max_tokens": 12, "stream": True}
        with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=60) as r:
            received = b"".join(r.iter_raw())
        assert len(tap.responses) == 1
        upstream = http_body(bytes(tap.responses[0]))
        # llama.cpp holds back tokens that end mid-UTF-8 character, so the event count varies; the
        # bytes must match exactly whatever it is.
        assert received == upstream and received.count(b"data: ") >= 5 and b'"timings"' in received
        assert received.endswith(b"data: [DONE]\n\n")
    finally:
        server.stop()
        tap.close()


def test_usage_injection_is_skipped_once_the_engine_reports_counts(engine, via):
    ask(via, 1)  # first stream: usage injected, the engine's timings seen
    via.last_record()  # the proxy learns when it finalizes the request, just after the last byte
    assert via.app.upstream.pool.reports_counts is True
    chunks = ask(via, 1)
    assert chunks[-1].usage is None  # nothing injected: the client's stream as llama.cpp sent it
    record = via.last_record()
    assert record["token_source"] == "engine" and record["completion_tokens"] == 16


def test_strip_engine_fields(engine):
    server = ProxyServer(f"{engine.url}/v1", strip_engine_fields=True)
    try:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": LINE}], "max_tokens": 4}
        plain = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
        assert plain.status_code == 200 and "timings" not in plain.json() and plain.json()["usage"]["completion_tokens"] == 4
        with httpx.stream("POST", f"{server.v1}/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            streamed = b"".join(r.iter_raw())
        assert b'"timings"' not in streamed and streamed.endswith(b"data: [DONE]\n\n")
        assert all(rec["engine"]["prompt_s"] > 0 for rec in server.wait_records(2))
    finally:
        server.stop()


def measure(server: ProxyServer, lines: int, n: int, tokens: int = 24) -> list[dict[str, Any]]:
    before = len(server.records())
    for _ in range(n):
        ask(server, lines, tokens)
    return server.wait_records(before + n)[before:]


def test_proxy_numbers_agree_with_the_engine(engine, via):
    ask(via, 1)  # warm: connection, first-call costs
    rows = []
    for lines in (1, 12):
        records = measure(via, lines, 20)
        # Greedy decoding of the random model can pick its end token first, or lock on a control
        # token, which detokenizes to nothing: such a stream has no content chunk, so no TTFT (seen
        # once in a full suite run under load). The model's, not the proxy's: held aside, a few at most.
        silent = [r for r in records if not r["content_chunks"]]
        assert all(r["ttft_s"] is None and r["outcome"] == "ok" for r in silent) and len(silent) <= 3
        records = [r for r in records if r["content_chunks"]]
        ttft = statistics.median(r["ttft_s"] for r in records)
        engine_prefill = statistics.median(r["engine"]["prompt_s"] for r in records)
        explained = statistics.median(r["engine"]["prompt_s"] + r["phases_s"]["network"] + r["phases_s"]["tokenize"] + r["phases_s"]["proxy"] for r in records)
        # A stream whose only content chunk is its first (the same model locking on a control token after it) has
        # no gap between content chunks: no per-token figure of its own (it divided by zero once, in a clean-clone run).
        decoding = [r for r in records if r["content_chunks"] > 1]
        assert len(decoding) >= len(records) - 3, [r["content_chunks"] for r in records]
        per_token = statistics.median(r["decode_s"] / (r["content_chunks"] - 1) for r in decoding)
        engine_per_token = statistics.median(r["engine"]["per_token_s"] for r in decoding)
        rows.append((records[0]["prompt_tokens"], ttft, engine_prefill, explained, per_token, engine_per_token,
                     statistics.median(r["phases_s"]["queue"] for r in records)))
        # TTFT = the engine's prefill + what the proxy measured around it, plus a small remainder
        # (llama.cpp's HTTP handling, its tokenizer, sampling the first token): bounded, not zero.
        assert engine_prefill < ttft
        assert ttft - explained < max(0.030, 0.25 * ttft)
        # Decode per token, proxy-measured between content chunks, within 25% of the engine's.
        assert per_token == pytest.approx(engine_per_token, rel=0.25)
    assert rows[1][0] > 5 * rows[0][0]
    assert rows[1][1] > rows[0][1] and rows[1][2] > rows[0][2]  # TTFT grows with the prompt, as the engine's prefill does
    growth_proxy, growth_engine = rows[1][1] - rows[0][1], rows[1][2] - rows[0][2]
    assert growth_proxy == pytest.approx(growth_engine, rel=0.3, abs=0.01)
    print("\n| prompt tokens | proxy TTFT ms | engine prompt_ms | TTFT - engine prefill ms | of which queue ms | proxy ms/token | engine ms/token |")
    print("|---|---|---|---|---|---|---|")
    for prompt, ttft, prefill, _, tok, etok, queue in rows:
        print(f"| {prompt} | {ttft * 1e3:.2f} | {prefill * 1e3:.2f} | {(ttft - prefill) * 1e3:.2f} | {queue * 1e3:.2f} | {tok * 1e3:.3f} | {etok * 1e3:.3f} |")


def test_batch_totals_agree_with_the_engine_metrics(engine, via):
    ask(via, 1)
    before = engine.metrics()
    records = measure(via, 4, 10, tokens=12)
    after = engine.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["llamacpp:prompt_tokens_total"] == sum(r["prompt_tokens"] for r in records)
    assert delta["llamacpp:tokens_predicted_total"] == sum(r["completion_tokens"] for r in records) == 120
    assert delta["llamacpp:prompt_seconds_total"] == pytest.approx(sum(r["engine"]["prompt_s"] for r in records), rel=0.01)
    assert delta["llamacpp:tokens_predicted_seconds_total"] == pytest.approx(sum(r["engine"]["decode_s"] for r in records), rel=0.01)
    labels = {"model": "tiny-llama", "upstream": via.settings.upstream_label, "endpoint": "chat", "stream": "true"}
    assert via.sample("llmproxy_engine_prefill_seconds_count", labels) == 11
    spans = via.exporter.get_finished_spans()
    assert any(s.name == "queue" for s in spans)
    server_span = next(s for s in spans if s.name == "chat tiny-llama")
    assert server_span.attributes["llmproxy.engine.source"] == "llama.cpp"


def test_the_responses_api_against_llama_cpp(engine, via):
    """The pinned llama.cpp server (xllamacpp 2026.10.11549) serves /v1/responses (it converts the
    request to a chat completion internally): the proxy times it as it times chat, and its numbers
    agree with the engine's metrics for the same requests."""
    c = openai.OpenAI(base_url=via.v1, api_key="sk-test", max_retries=0)
    before_records, before = len(via.records()), engine.metrics()
    finals = []
    for _ in range(4):
        prompt = f"# request {time.monotonic_ns()}\n" + LINE * 4
        events = list(c.responses.create(model="tiny-llama", input=prompt, max_output_tokens=12, stream=True, temperature=0))
        assert events[-1].type == "response.completed"
        finals.append(events[-1].response)
    records = via.wait_records(before_records + 4)[before_records:]
    after = engine.metrics()
    assert all(r["endpoint"] == "responses" and r["outcome"] == "ok" and r["stream"] for r in records)
    assert [r["completion_tokens"] for r in records] == [f.usage.output_tokens for f in finals]
    assert all(r["token_source"] == "usage" and r["ttft_s"] is not None and r["content_chunks"] >= 2 for r in records)
    generated = after["llamacpp:tokens_predicted_total"] - before.get("llamacpp:tokens_predicted_total", 0.0)
    assert generated == sum(r["completion_tokens"] for r in records)
    assert all(r["ttft_s"] < r["duration_s"] and r["decode_tokens_per_second"] > 0 for r in records)


def test_the_anthropic_messages_api_against_llama_cpp(engine, via):
    """The pinned llama.cpp server serves Anthropic's /v1/messages (so that Claude Code runs on a local
    model). Its Messages stream carries no `timings`, so each request is checked against the engine's
    own counters read around it: output tokens equal its tokens_predicted, and TTFT covers its
    prompt processing time (prompt_seconds) plus a bounded remainder, as for chat."""
    import anthropic

    c = anthropic.Anthropic(base_url=via.url, api_key="sk-ant-test", max_retries=0)
    rows = []
    for stream in (True, True, True, False):
        before, count = engine.metrics(), len(via.records())
        prompt = f"# request {time.monotonic_ns()}\n" + LINE * 6
        kwargs = {"model": "tiny-llama", "max_tokens": 12, "messages": [{"role": "user", "content": prompt}], "extra_body": {"temperature": 0}}
        if stream:
            with c.messages.stream(**kwargs) as s:
                final = s.get_final_message()
        else:
            final = c.messages.create(**kwargs)
        record = via.wait_records(count + 1)[-1]
        after = engine.metrics()
        predicted = after["llamacpp:tokens_predicted_total"] - before.get("llamacpp:tokens_predicted_total", 0.0)
        prompt_s = after["llamacpp:prompt_seconds_total"] - before.get("llamacpp:prompt_seconds_total", 0.0)
        assert record["api"] == "anthropic" and record["endpoint"] == "messages" and record["outcome"] == "ok"
        assert record["completion_tokens"] == final.usage.output_tokens == predicted and record["token_source"] == "usage"
        assert record["prompt_tokens"] == final.usage.input_tokens
        if stream:
            assert record["content_chunks"] >= 2 and prompt_s < record["ttft_s"]
            assert record["ttft_s"] - prompt_s < max(0.030, 0.25 * record["ttft_s"])
            rows.append((record["prompt_tokens"], record["ttft_s"], prompt_s, record["decode_tokens_per_second"], predicted))
    print("\n| prompt tokens | proxy TTFT ms | engine prompt ms | proxy decode tok/s | output tokens = tokens_predicted |")
    print("|---|---|---|---|---|")
    for prompt, ttft, prefill, tps, predicted in rows:
        print(f"| {prompt} | {ttft * 1e3:.2f} | {prefill * 1e3:.2f} | {tps:.1f} | {predicted:.0f} |")


def test_explain_over_llama_cpp_agrees_with_its_timings(engine, tmp_path):
    """`explain` over real llama.cpp traffic (prompts of 1 to 16 lines, from its records database):
    its fitted prefill and decode rates agree with the engine's own `timings` of the same requests (its prefill
    rate: the same fit over the engine's own prompt times, so that both are rates past the fixed cost)."""
    from proxy.answers.explain import explain, gather, render, theil_sen
    from proxy.records import open_backend

    path = tmp_path / "records.sqlite"
    server = ProxyServer(f"{engine.url}/v1", records_db=str(path))
    try:
        ask(server, 1)
        for lines in (1, 4, 8, 12, 16) * 3:
            ask(server, lines, 16)
        records = server.wait_records(16)[1:]
    finally:
        server.stop()
    report = explain(gather([open_backend(str(path))]))
    (group,) = report.values()
    engine_fit = theil_sen([(float(r["engine"]["prompt_tokens"]), r["engine"]["prompt_s"]) for r in records])
    assert engine_fit is not None and engine_fit.slope > 0
    engine_prefill = 1.0 / engine_fit.slope
    engine_itl = statistics.median(r["engine"]["per_token_s"] for r in records)
    assert group["prefill"]["tokens_per_second"] == pytest.approx(engine_prefill, rel=0.25)
    assert group["decode"]["itl_at_1_s"] == pytest.approx(engine_itl, rel=0.25)
    print(f"\nengine: prefill {engine_prefill:,.0f} tok/s, {engine_itl * 1000:.2f} ms per token\n" + render(report))
