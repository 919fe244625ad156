"""Every API the proxy measures, against one injected schedule: what the proxy reports vs the truth.

The simulator's schedule per request: TTFT 200 ms, then 51 tokens at 50 tok/s (so decode = 50
gaps of 20 ms). Each API is driven by its own official client through one proxy (`--src` for
another checkout), interleaved over `--repeats`; the table gives medians of the proxy's records.

    .venv/bin/python -m bench.truth apis [--repeats 10] [--src DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import anthropic
import httpx
import ollama
import openai
from google import genai
from google.genai import types

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import simulator  # noqa: E402

from proxy.processes import free_port, serve_command, started  # noqa: E402

SCHEDULE = {"x-sim-ttft-ms": "200", "x-sim-decode-tps": "50"}
TOKENS = 51
MESSAGES = [{"role": "user", "content": "hello there"}]


def calls(base: str) -> dict[str, Callable[[], Any]]:
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0)
    azure = openai.AzureOpenAI(azure_endpoint=base, api_key="bench", api_version="2024-10-21", max_retries=0)
    claude = anthropic.Anthropic(base_url=base, api_key="bench", max_retries=0)
    gemini = genai.Client(api_key="bench", http_options=types.HttpOptions(base_url=base, headers=SCHEDULE))
    local = ollama.Client(host=base, headers=SCHEDULE)

    def anthropic_stream() -> None:
        with claude.messages.stream(model="sim-7b", max_tokens=TOKENS, messages=MESSAGES, extra_headers=SCHEDULE) as s:  # type: ignore[arg-type]
            s.until_done()

    def gzip_chat() -> None:
        body = {"model": "sim-7b", "messages": MESSAGES, "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60,
                          headers={**SCHEDULE, "x-sim-content-encoding": "gzip", "accept-encoding": "gzip"}) as r:
            for _ in r.iter_raw():
                pass

    return {
        "openai chat": lambda: list(oai.chat.completions.create(model="sim-7b", messages=MESSAGES, max_tokens=TOKENS, stream=True,  # type: ignore[arg-type]
                                                                 extra_headers=SCHEDULE)),
        "openai responses": lambda: list(oai.responses.create(model="sim-7b", input="hello there", max_output_tokens=TOKENS, stream=True,
                                                              extra_headers=SCHEDULE)),
        "azure chat (deployment path)": lambda: list(azure.chat.completions.create(model="sim-7b", messages=MESSAGES, max_tokens=TOKENS,  # type: ignore[arg-type]
                                                                                  stream=True, extra_headers=SCHEDULE)),
        "anthropic messages": anthropic_stream,
        "gemini (google-genai, SSE)": lambda: list(gemini.models.generate_content_stream(
            model="sim-7b", contents="hello there", config=types.GenerateContentConfig(max_output_tokens=TOKENS))),
        "ollama chat (NDJSON)": lambda: list(local.chat(model="sim-7b", messages=MESSAGES, stream=True, options={"num_predict": TOKENS})),
        "openai chat, gzip stream": gzip_chat,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2]))
    args = parser.parse_args()
    sim_port, port = free_port(), free_port()
    sim, base = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{port}"
    records: dict[str, list[dict[str, Any]]] = {}
    with simulator(sim_port), \
         started([], f"{base}/healthz", command=serve_command(args.src, "serve", "--upstream", sim, "--port", str(port),
                                                              "--records-db", ""), quiet=True):
        apis = calls(base)
        for call in apis.values():  # warm-up
            call()
        for _ in range(args.repeats):
            for name, call in apis.items():
                call()
                time.sleep(0.05)
                records.setdefault(name, []).append(httpx.get(f"{base}/llmproxy/requests", params={"limit": 1}).json()[-1])
    print(f"schedule: TTFT 200 ms, then {TOKENS} tokens at 50 tok/s; medians of {args.repeats}")
    print("| api | recorded as | TTFT ms (truth 200) | decode tok/s (truth 50) | completion tokens (truth 51) | prompt tokens | token source |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in records.items():
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        print(f"| {name} | {rs[0]['api']} {rs[0]['endpoint']} | {med('ttft_s') * 1000:.2f} | {med('decode_tokens_per_second'):.2f} | "
              f"{med('completion_tokens'):.0f} | {med('prompt_tokens'):.0f} | {rs[0]['token_source']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
