"""The figure the proxy reports for each production-shaped stream of issue "true numbers", against
a proxy run from any checkout (--src), on this checkout's simulator. Run it on an old worktree and
on this one for a before/after table. Each row: the shape, what the proxy reports, the truth.

    .venv/bin/python -m bench.truth shapes [--src DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from typing import Any, Iterator

import httpx
import orjson

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.harness import simulator  # noqa: E402

from proxy.processes import free_port, serve_command, started  # noqa: E402

MSG = [{"role": "user", "content": "hello"}]


@contextlib.contextmanager
def proxy(src: str, sim: str, *flags: str) -> Iterator[str]:
    port = free_port()
    command = serve_command(src, "serve", "--upstream", f"{sim}/v1", "--port", str(port), *flags)
    with started([], f"http://127.0.0.1:{port}/healthz", command=command, quiet=True):
        yield f"http://127.0.0.1:{port}"


def last(base: str) -> dict[str, Any]:
    time.sleep(0.3)
    return httpx.get(f"{base}/llmproxy/requests", params={"limit": 1}).json()[-1]


def chat(base: str, tokens: int, headers: dict[str, str] | None = None, **extra: Any) -> bytes:
    body = {"model": "sim-7b", "messages": MSG, "max_tokens": tokens, "stream": True, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers or {}, timeout=60).content


def respond(base: str, tokens: int, headers: dict[str, str] | None = None, text: str = "hello") -> bytes:
    body = {"model": "sim-7b", "input": text, "max_output_tokens": tokens, "stream": True}
    return httpx.post(f"{base}/v1/responses", json=body, headers=headers or {}, timeout=60).content


def metric(base: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rows(src: str, sim: str) -> Iterator[tuple[str, str, str]]:
    f = lambda v, fmt="{:.1f}": "n/a" if v is None else fmt.format(v)  # noqa: E731
    with proxy(src, sim) as p:
        chat(p, 21, {"x-sim-hidden-reasoning": "100", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "100"})
        r = last(p)
        yield ("hidden reasoning: 100 tokens, then 21 visible at 100 tok/s, prefill 0.1 s",
               f"decode {f(r['decode_tokens_per_second'])} tok/s; prefill {f(r['phases_s'].get('prefill'), '{:.2f}')} s; "
               f"reasoning {f(r['phases_s'].get('reasoning'), '{:.2f}')} s", "100 tok/s; prefill 0.10 s; reasoning 1.00 s")
        chat(p, 21, {"x-sim-decode-tps": "50", "x-sim-ttft-ms": "20"}, n=2)
        r = last(p)
        yield ("n=2, each choice at 50 tok/s", f"decode {f(r['decode_tokens_per_second'])} tok/s; ITL p50 {f(r['inter_token_p50_s'] * 1000)} ms",
               "50 tok/s; 20 ms")
        chat(p, 40, {"x-sim-chunk-pattern": "4,4,2", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "10"})
        yield ("chunks of 4, 4, 2 tokens at 100 tok/s", f"decode {f(last(p)['decode_tokens_per_second'])} tok/s", "100 tok/s")
        prompt = " the" * 1993
        httpx.post(f"{p}/v1/chat/completions", json={"model": "sim-7b", "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "stream": True},
                   headers={"x-sim-cached-tokens": "1900"}, timeout=60)
        r = last(p)
        yield ("2,000-token prompt, 1,900 cached, prefill 5,000 tok/s", f"prefill {f(r['prefill_tokens_per_second'], '{:,.0f}')} tok/s",
               "100 uncached tokens / prefill ≈ 5,000 tok/s")
        body = orjson.dumps({"model": "sim-7b", "messages": [{"role": "user", "content": " the" * (1280 * 1024)}], "max_tokens": 3})
        def slowly() -> Iterator[bytes]:
            for i in range(0, len(body), 512 * 1024):
                time.sleep(0.15)
                yield body[i:i + 512 * 1024]
        httpx.post(f"{p}/v1/chat/completions", content=slowly(), headers={"content-type": "application/json", "x-sim-ttft-ms": "10"}, timeout=60)
        r = last(p)
        yield ("a client uploading a 5 MB body over 1.6 s", f"proxy {f(r['phases_s'].get('proxy'), '{:.2f}')} s; client {f(r['phases_s'].get('client'), '{:.2f}')} s",
               "proxy ≈ 0; client ≈ 1.6 s")
        chat(p, 3, stream_options={"include_usage": 1})
        raw = chat(p, 3, stream_options={"include_usage": 1})
        yield ('client sends "include_usage": 1', "usage chunk kept" if b'"prompt_tokens"' in raw else "usage chunk dropped", "kept")
        raw = chat(p, 3, stream_options={"continuous_usage_stats": True})
        yield ("continuous_usage_stats without include_usage", "usage reaches the client" if b'"prompt_tokens"' in raw else "no usage (as asked)",
               "no usage (as asked)")
        for field in ("refusal", "function_call"):
            chat(p, 5, {"x-sim-delta-field": field, "x-sim-ttft-ms": "50"})
            yield (f"{field} deltas, TTFT 50 ms", f"TTFT {f(last(p)['ttft_s'] and last(p)['ttft_s'] * 1000)} ms", "50 ms")
        tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        image = [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with proxy(src, sim, "--inject-usage", "false") as p:
        chat(p, 20, {"x-sim-visible-reasoning": "20", "x-sim-reasoning-field": "both", "x-sim-decode-tps": "50", "x-sim-ttft-ms": "10"})
        r = last(p)
        yield ("vLLM reasoning in both fields, then content, 50 tok/s, no usage", f"decode {f(r['decode_tokens_per_second'])} tok/s; "
               f"ITL p50 {f(r['inter_token_p50_s'] * 1000)} ms", "50 tok/s; 20 ms")
        counts = []
        for extra in ({}, {"tools": tools}):
            httpx.post(f"{p}/v1/chat/completions", json={"model": "sim-7b", "messages": image, "max_tokens": 2, "stream": True, **extra}, timeout=60)
            counts.append(last(p))
        yield ("prompt with an image part; the same with tools", f"{counts[0]['prompt_tokens']} / {counts[1]['prompt_tokens']} tokens; "
               f"uncounted parts: {counts[0].get('prompt_uncounted_parts', 'not reported')}", "tools counted; the image reported as uncounted")
    with proxy(src, sim, "--max-connections", "1", "--pool-timeout", "0.3") as p:
        holder = threading.Thread(target=chat, args=(p, 40, {"x-sim-decode-tps": "50"}))
        holder.start()
        time.sleep(0.2)
        httpx.post(f"{p}/v1/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 2}, timeout=10)
        holder.join()
        seconds = metric(p, "llmproxy_phase_seconds_total", stream="false") or metric(p, "llmproxy_phase_seconds_sum", stream="false")
        yield ("pool timeout (0.3 s) beside a successful stream", f"{seconds:.2f} s of errors in llmproxy_phase_seconds", "0 s: errors kept apart")
    with proxy(src, sim, "--first-token-timeout", "1") as p:
        start = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{p}/v1/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 3, "stream": True},
                       headers={"x-sim-keepalive-ms": "100", "x-sim-ttft-ms": "8000"}, timeout=30)
        yield ("headers, then `: keep-alive` every 100 ms (first token at 8 s), --first-token-timeout 1",
               f"client's stream ended after {time.monotonic() - start:.1f} s", "≤ 2 s, outcome timeout")
    with proxy(src, sim, "--read-timeout", "0.5") as p:
        body2 = {"model": "sim-7b", "messages": MSG, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{p}/v1/chat/completions", json=body2, timeout=30,
                          headers={"x-sim-token-bytes": "100000", "x-sim-decode-tps": "100000", "x-sim-ttft-ms": "0"}) as response:
            reader = response.iter_raw()
            next(reader)
            time.sleep(2.5)
        yield ("client stops reading for 2.5 s, --read-timeout 0.5", f"outcome {last(p)['outcome']}", "client_slow")
    with proxy(src, sim, "--strip-engine-fields", "true") as p:
        status = httpx.post(f"{p}/v1/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 3},
                            headers={"x-sim-drop-body": "1"}, timeout=10).status_code
        time.sleep(0.3)
        yield ("--strip-engine-fields, non-streaming, upstream fails mid-body",
               f"HTTP {status}; in flight after: {metric(p, 'llmproxy_requests_in_flight'):g}", "502; 0")
    with proxy(src, sim) as p:
        statuses = [httpx.post(f"{p}/v1/chat/completions", json={"model": "sim-7b", "messages": MSG, "max_tokens": 3, "stream": True},
                               headers={"x-sim-reject-stream-options": "1"}, timeout=10).status_code for _ in range(2)]
        yield ("upstream rejecting stream_options (old Azure)", f"HTTP {statuses[0]}, {statuses[1]}", "200, 200")


def responses_rows(src: str, sim: str) -> Iterator[tuple[str, str, str]]:
    """The Responses API against the same schedules (medians of 10 where a figure is timed)."""
    import statistics

    f = lambda v, fmt="{:.1f}": "n/a" if v is None else fmt.format(v)  # noqa: E731
    with proxy(src, sim) as p:
        for name, send in (("chat", chat), ("Responses API", respond)):
            ttft, tps = [], []
            for _ in range(10):
                send(p, 51, {"x-sim-ttft-ms": "200", "x-sim-decode-tps": "50"})
                r = last(p)
                ttft.append(r["ttft_s"] or 0.0)
                tps.append(r["decode_tokens_per_second"] or 0.0)
            yield (f"{name}: TTFT 200 ms, then 51 tokens at 50 tok/s (median of 10)",
                   f"TTFT {statistics.median(ttft) * 1000:.1f} ms; decode {statistics.median(tps):.2f} tok/s; endpoint {r['endpoint']}",
                   "200 ms (+ loopback); 50 tok/s")
        respond(p, 21, {"x-sim-hidden-reasoning": "100", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "100"})
        r = last(p)
        yield ("Responses API: hidden reasoning 100 tokens, then 21 visible at 100 tok/s, prefill 0.1 s",
               f"decode {f(r['decode_tokens_per_second'])} tok/s; prefill {f(r['phases_s'].get('prefill'), '{:.2f}')} s; "
               f"reasoning {f(r['phases_s'].get('reasoning'), '{:.2f}')} s; hidden {r['hidden_reasoning_tokens']}",
               "100 tok/s; prefill 0.10 s; reasoning 1.00 s; hidden 100")
        respond(p, 40, {"x-sim-chunk-pattern": "4,4,2", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "10"})
        yield ("Responses API: deltas of 4, 4, 2 tokens at 100 tok/s", f"decode {f(last(p)['decode_tokens_per_second'])} tok/s", "100 tok/s")
        respond(p, 10, {"x-sim-visible-reasoning": "10", "x-sim-decode-tps": "100", "x-sim-ttft-ms": "50"})
        r = last(p)
        yield ("Responses API: 10 reasoning_text deltas, then 10 output_text, TTFT 50 ms",
               f"TTFT {f(r['ttft_s'] * 1000)} ms; chunks {r['content_chunks']}; decode {f(r['decode_tokens_per_second'])} tok/s",
               "50 ms; 20; 100 tok/s")
        respond(p, 3, {"x-sim-cached-tokens": "1900"}, text=" the" * 1993)
        r = last(p)
        yield ("Responses API: 2,000-token input, 1,900 cached, prefill 5,000 tok/s",
               f"prefill {f(r['prefill_tokens_per_second'], '{:,.0f}')} tok/s; cached {r['cached_prompt_tokens']}", "5,000 tok/s; cached 1900")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--no-responses", action="store_true", help="skip the Responses API rows (a checkout from before it)")
    args = parser.parse_args()
    sim_port = free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    src = os.path.abspath(args.src)
    with simulator(sim_port):
        print(f"proxy from {src}\n\n| shape | proxy reports | true |\n|---|---|---|")
        for shape, reported, truth in rows(src, sim):
            print(f"| {shape} | {reported} | {truth} |", flush=True)
        if not args.no_responses:
            for shape, reported, truth in responses_rows(src, sim):
                print(f"| {shape} | {reported} | {truth} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
