"""Ollama's own API measured like chat, with its engine timings joined: the official `ollama`
client through the proxy (stream and not, chat and generate, embed, tags), recorded NDJSON bytes
with `thinking` and the timings (figures by hand), and bad input."""
from __future__ import annotations

import httpx
import ollama
import orjson
import pytest

from servers import raw_upstream

pytestmark = pytest.mark.e2e
SCHEDULE = {"x-sim-ttft-ms": "200", "x-sim-decode-tps": "50", "x-sim-load-ms": "300"}
MESSAGES = [{"role": "user", "content": "hello there"}]


def test_chat_streamed_with_a_cold_load_and_the_engine_join(proxy_factory, sim):
    proxy = proxy_factory(upstream=sim.url)  # Ollama's host: an origin
    client = ollama.Client(host=proxy.url, headers=SCHEDULE)
    parts = list(client.chat(model="sim-7b", messages=MESSAGES, stream=True, options={"num_predict": 51}))
    final = parts[-1]
    assert final.done and final.eval_count == 51 and final.load_duration == 300_000_000
    record = proxy.last_record()
    assert record["api"] == "ollama" and record["endpoint"] == "ollama_chat" and record["stream"] is True and record["outcome"] == "ok"
    # TTFT = the 300 ms load + the 200 ms prefill; decode 50 gaps of 20 ms.
    delivered = sim.delivered()
    assert delivered.ttft_s == pytest.approx(0.500, abs=0.05)  # (the load was scheduled)
    assert delivered.holds_ttft(record) and delivered.holds_rate(record["decode_tokens_per_second"], 50)
    assert record["completion_tokens"] == 51 and record["prompt_tokens"] == final.prompt_eval_count and record["token_source"] == "usage"
    engine = record["engine"]
    assert engine["source"] == "ollama" and engine["prompt_s"] == pytest.approx(0.200, abs=0.001)
    assert engine["per_token_s"] == pytest.approx(final.eval_duration / 51 / 1e9) and engine["load_s"] == pytest.approx(0.300)
    phases = record["phases_s"]
    assert phases["prefill"] == pytest.approx(0.200, abs=0.001)  # the engine's own prefill
    assert phases["load"] == pytest.approx(0.300, abs=0.012)  # the cold load, its own phase
    assert sum(phases.values()) == pytest.approx(record["duration_s"], abs=1e-6)


def test_generate_not_streamed_thinking_embed_and_tags(proxy_factory, sim):
    proxy = proxy_factory(upstream=sim.url)
    client = ollama.Client(host=proxy.url, headers={"x-sim-ttft-ms": "20"})
    whole = client.generate(model="sim-7b", prompt="hello", stream=False, options={"num_predict": 7})
    record = proxy.last_record()
    assert record["endpoint"] == "ollama_generate" and record["stream"] is False and record["completion_tokens"] == whole.eval_count == 7
    assert "prefill" in record["phases_s"] and record["engine"]["source"] == "ollama"
    thinking = ollama.Client(host=proxy.url, headers={"x-sim-visible-reasoning": "4", "x-sim-ttft-ms": "20"})
    parts = list(thinking.chat(model="sim-7b", messages=MESSAGES, stream=True, options={"num_predict": 5}))
    assert sum(1 for p in parts if p.message.thinking) == 4
    record = proxy.last_record()
    assert record["content_chunks"] == 9 and record["reasoning_tokens"] is None and record["completion_tokens"] == 9  # thinking is decode
    vectors = client.embed(model="sim-7b", input=["a", "b"])
    assert len(vectors.embeddings) == 2 and proxy.last_record()["endpoint"] == "ollama_embed"
    assert proxy.last_record()["prompt_tokens"] == vectors.prompt_eval_count
    assert client.list().models[0].model == "sim-7b:latest" and proxy.last_record()["endpoint"] == "ollama_other"


# Recorded: Ollama's /api/chat NDJSON for a thinking model (message.thinking, then content), its
# last object with the counts and timings (ns).
RECORDED = [
    b'{"model":"qwen3:8b","created_at":"2026-05-01T10:00:00.1Z","message":{"role":"assistant","content":"","thinking":"Okay"},"done":false}\n',
    b'{"model":"qwen3:8b","created_at":"2026-05-01T10:00:00.2Z","message":{"role":"assistant","content":"","thinking":", the user"},"done":false}\n',
    b'{"model":"qwen3:8b","created_at":"2026-05-01T10:00:00.3Z","message":{"role":"assistant","content":"Hello"},"done":false}\n',
    b'{"model":"qwen3:8b","created_at":"2026-05-01T10:00:00.4Z","message":{"role":"assistant","content":"!"},"done":false}\n',
    b'{"model":"qwen3:8b","created_at":"2026-05-01T10:00:00.5Z","message":{"role":"assistant","content":""},"done":true,"done_reason":"stop",'
    b'"total_duration":2500000000,"load_duration":1800000000,"prompt_eval_count":26,"prompt_eval_duration":130000000,'
    b'"eval_count":40,"eval_duration":520000000}\n',
]


def test_recorded_ndjson_and_the_engine_join_by_hand(proxy_factory):
    with raw_upstream(RECORDED, gap_s=0.010, content_type="application/x-ndjson") as up:
        proxy = proxy_factory(upstream=up.url)
        via = httpx.post(f"{proxy.url}/api/chat", json={"model": "qwen3:8b", "messages": MESSAGES}, timeout=30).content  # stream defaults to true
        record = proxy.last_record()
    assert via == b"".join(RECORDED)
    assert record["stream"] is True and record["content_chunks"] == 4 and record["reasoning_tokens"] is None
    assert record["prompt_tokens"] == 26 and record["completion_tokens"] == 40 and record["token_source"] == "usage"
    engine = record["engine"]
    assert engine["prompt_s"] == pytest.approx(0.130) and engine["load_s"] == pytest.approx(1.8)
    assert engine["per_token_s"] == pytest.approx(0.520 / 40)  # eval_duration / eval_count = 13 ms per token
    # The proxy saw ~10 ms before the first token: the engine's 130 ms prefill and 1.8 s load cannot fit
    # in it, so the split keeps the proxy's own clock (prefill capped to what was seen, no room for load).
    assert record["phases_s"]["prefill"] <= record["ttft_s"] and record["phases_s"].get("load", 0.0) == 0.0
    assert sum(record["phases_s"].values()) == pytest.approx(record["duration_s"], abs=1e-6)


def test_a_truncated_line_and_an_error_mid_stream(proxy_factory):
    cut = RECORDED[:2] + [RECORDED[2][:30]]
    with raw_upstream(cut, gap_s=0.005, content_type="application/x-ndjson", close=True) as up:
        proxy = proxy_factory(upstream=up.url)
        got = b""
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", f"{proxy.url}/api/chat", json={"model": "m", "messages": MESSAGES}, timeout=30) as response:
                for part in response.iter_raw():
                    got += part
        record = proxy.last_record()
    assert got == b"".join(cut) and record["content_chunks"] == 2 and record["outcome"] == "upstream_error"
    assert record["error"] == "mid_stream:upstream_protocol_error" and record["malformed_chunks"] == 0  # the cut line is no event
    # The upstream keeps its connection 50 ms after the error line: the SDK raises on that line and
    # leaves first, and the request is still the upstream's error, not a client disconnect.
    failing = RECORDED[:3] + [b'{"error":"model runner has unexpectedly stopped"}\n', b"\n"]
    with raw_upstream(failing, gap_s=0.05, content_type="application/x-ndjson") as up:
        proxy = proxy_factory(upstream=up.url)
        with pytest.raises(ollama.ResponseError):
            list(ollama.Client(host=proxy.url).chat(model="m", messages=MESSAGES, stream=True))
        record = proxy.last_record()
    assert record["outcome"] == "upstream_error" and record["error"] == "stream_error:error" and record["content_chunks"] == 3
    assert orjson.loads(failing[-2])["error"]  # (the line the client raised on)
