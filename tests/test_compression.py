"""Compressed upstream streams and bodies (gzip, deflate, br, zstd): read through a streaming
decoder with per-read timestamps intact, the client's bytes as the upstream sent them, identity
asked for where the proxy rewrites, and undecodable bytes relayed untouched and counted."""
from __future__ import annotations

import zlib

import brotli
import httpx
import openai
import orjson
import pytest
import zstandard

from proxy.wire.compression import DecodeError, Decoder
from servers import raw_upstream

pytestmark = pytest.mark.e2e
CHAT = {"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
SCHEDULE = {"x-sim-ttft-ms": "100", "x-sim-decode-tps": "100"}


def unmeasured(proxy, reason: str) -> float:
    return proxy.sample("llmproxy_unmeasured_requests_total", {"upstream": proxy.settings.upstream_label, "reason": reason}) or 0.0


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
def test_a_compressed_stream_the_client_asked_for_is_measured_and_unchanged(proxy, sim, encoding):
    """The client asked for usage itself, so nothing is rewritten: the compressed bytes go through."""
    body = {**CHAT, "stream_options": {"include_usage": True}}
    headers = {**SCHEDULE, "x-sim-content-encoding": encoding, "accept-encoding": encoding}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers=headers, timeout=30) as response:
        assert response.headers["content-encoding"] == encoding
        via = b"".join(response.iter_raw())
    delivered = sim.delivered()
    with httpx.stream("POST", f"{sim.url}/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
        direct = b"".join(response.iter_raw())
    assert via == direct  # (the simulator is deterministic: same request, same bytes)
    record = proxy.last_record()
    assert delivered.holds_ttft(record) and delivered.holds_rate(record["decode_tokens_per_second"], 19)
    assert record["content_chunks"] == 20 and record["completion_tokens"] == 20 and record["token_source"] == "usage"
    assert record["unmeasured"] == ""


def test_where_the_proxy_injects_usage_it_asks_for_identity(proxy, sim):
    client = openai.OpenAI(base_url=proxy.v1, api_key="k", max_retries=0)  # accepts gzip, deflate (and br, zstd: both installed)
    chunks = list(client.chat.completions.create(**CHAT, extra_headers={**SCHEDULE, "x-sim-content-encoding": "gzip"}))
    delivered = sim.delivered()  # (what the simulator really did: its 100 ms sleep can overshoot on a loaded machine)
    assert sim.stats()["last_headers"]["accept-encoding"] == "identity"
    assert all(c.usage is None for c in chunks) and sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 20
    record = proxy.last_record()
    assert record["completion_tokens"] == 20 and record["token_source"] == "usage" and delivered.holds_ttft(record)


def test_an_upstream_that_compresses_anyway_is_decoded_for_the_client(proxy, sim):
    """It ignored `accept-encoding: identity`: the proxy still strips what it injected, and sends the
    client the decoded stream (which every client accepts), never a chunk it did not ask for."""
    headers = {**SCHEDULE, "x-sim-content-encoding": "gzip", "x-sim-force-encoding": "1"}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=CHAT, headers=headers, timeout=30) as response:
        assert "content-encoding" not in response.headers
        text = b"".join(response.iter_raw())
    assert b'"usage"' not in text and text.endswith(b"data: [DONE]\n\n")
    record = proxy.last_record()
    assert record["completion_tokens"] == 20 and record["token_source"] == "usage" and record["content_chunks"] == 20


@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip"])
def test_non_streaming_bodies_are_read_whatever_the_encoding(proxy, encoding):
    response = httpx.post(f"{proxy.v1}/chat/completions", json={**CHAT, "stream": False, "max_tokens": 7},
                          headers={"x-sim-content-encoding": encoding, "accept-encoding": encoding}, timeout=30)
    assert response.headers["content-encoding"] == encoding and response.json()["usage"]["completion_tokens"] == 7
    record = proxy.last_record()
    assert record["completion_tokens"] == 7 and record["token_source"] == "usage" and record["unmeasured"] == ""


def test_undecodable_bytes_are_relayed_untouched_and_counted(proxy, sim):
    body = {**CHAT, "stream_options": {"include_usage": True}}
    headers = {"x-sim-content-encoding": "gzip", "x-sim-corrupt-encoding": "1", "accept-encoding": "gzip", "x-sim-ttft-ms": "0"}
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers=headers, timeout=30) as response:
        via = b"".join(response.iter_raw())
    with httpx.stream("POST", f"{sim.url}/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
        direct = b"".join(response.iter_raw())
    assert via == direct and via.startswith(b"\x00not-gzip")
    record = proxy.last_record()
    assert record["unmeasured"] == "undecodable" and record["outcome"] == "ok" and record["content_chunks"] == 0
    assert unmeasured(proxy, "undecodable") == 1
    with httpx.stream("POST", f"{proxy.v1}/chat/completions", json={**CHAT, "stream": False}, headers=headers, timeout=30) as response:
        assert b"".join(response.iter_raw()).startswith(b"\x00not-gzip")
    assert proxy.last_record()["unmeasured"] == "undecodable" and unmeasured(proxy, "undecodable") == 2


def test_a_recorded_gzip_stream_through_the_proxy(proxy_factory):
    """An OpenAI stream gzipped and flushed per event, one write each 10 ms: figures by hand."""
    events = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n']
    events += [b'data: {"choices":[{"index":0,"delta":{"content":" w%d"}}]}\n\n' % k for k in range(5)]
    events += [b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5}}\n\n', b"data: [DONE]\n\n"]
    deflate = zlib.compressobj(wbits=31)
    writes = [deflate.compress(e) + deflate.flush(zlib.Z_SYNC_FLUSH) for e in events]
    writes[-1] += deflate.flush()
    with raw_upstream(writes, gap_s=0.010, headers=[("content-encoding", "gzip")]) as up:
        proxy = proxy_factory(upstream=up.url)
        body = orjson.dumps({**CHAT, "stream_options": {"include_usage": True}})
        with httpx.stream("POST", f"{proxy.v1}/chat/completions", content=body, headers={"accept-encoding": "gzip"}, timeout=30) as response:
            via = b"".join(response.iter_raw())
        record = proxy.last_record()
    assert via == b"".join(writes)
    assert zlib.decompress(via, 31) == b"".join(events)
    assert record["content_chunks"] == 5 and record["completion_tokens"] == 5 and record["prompt_tokens"] == 9
    assert 0.019 <= record["phases_s"]["prefill"] <= 0.040  # the 2nd write (the role chunk is not content); sleeps never end early
    assert 0.035 <= record["decode_s"] <= 0.065  # 4 gaps of 10 ms (generous: the fixture is a thread of this busy process)


def test_the_decoders_bound_what_one_read_expands_to():
    bomb = zlib.compress(b"\0" * 10_000_000)
    with pytest.raises(DecodeError):
        Decoder(b"deflate", 1_000_000).feed(bomb)
    with pytest.raises(DecodeError):
        Decoder(b"br", 1_000_000).feed(brotli.compress(b"\0" * 10_000_000))
    assert Decoder(b"zstd", 1 << 20).feed(zstandard.ZstdCompressor().compress(b"data: x\n\n")) == b"data: x\n\n"
    raw = zlib.compressobj(wbits=-15)
    assert Decoder(b"deflate", 1 << 20).feed(raw.compress(b"raw deflate") + raw.flush()) == b"raw deflate"  # some servers send it
    with pytest.raises(DecodeError):
        Decoder(b"compress", 1 << 20)
