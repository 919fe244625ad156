"""`llm-latency-proxy load`: a bounded traffic mix for dashboards, alerts and soak runs.

Each of `concurrency` workers loops until `duration_s` passes or `requests` were sent: chat or
completions or the Responses API, streaming or not, prompt lengths from short to long, two model names, and a small
share of injected upstream errors (the simulator's `x-sim-error-status`), and the production shapes
of prompt caching and hidden reasoning. With `keys`, request i carries key i mod len(keys) (and
an end user `user-<n>` in the API's own field): tenants told apart by their keys (tenants.py), as
two applications would be; `mixes` gives each key its own traffic. It talks raw HTTP with httpx
so the load generator stays cheap on a small machine.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on")


@dataclass
class Mix:
    models: tuple[str, ...] = ("sim-7b", "sim-70b")
    prompt_tokens: tuple[int, ...] = (50, 200, 1000, 3000)
    max_tokens: tuple[int, ...] = (10, 30, 60)
    stream_share: float = 0.85
    chat_share: float = 0.8  # of the requests that are not Responses API ones (the rest: completions)
    responses_share: float = 0.15
    messages_share: float = 0.10  # Anthropic's Messages API (Claude Code, the anthropic SDK)
    gemini_share: float = 0.07  # Gemini's :streamGenerateContent / :generateContent
    ollama_share: float = 0.07  # Ollama's /api/chat
    error_share: float = 0.03
    extra_headers: dict[str, str] = field(default_factory=dict)
    # Production shapes (the simulator's x-sim-* headers), one chosen per request: prompt caching
    # (half the prompt cached) and a reasoning model's hidden reasoning.
    cached_share: float = 0.2
    hidden_reasoning_share: float = 0.1


# Named mixes (`load --shapes`, one per key): two applications with different traffic, as `make demo` shows them.
SHAPES = {"default": Mix(), "long-prompts": Mix(prompt_tokens=(4000, 8000), max_tokens=(10, 20)),
          "long-answers": Mix(prompt_tokens=(50, 200), max_tokens=(300, 600))}


@dataclass
class LoadResult:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: int = 0  # transport errors at the client


def _prompt(tokens: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(tokens))


async def _one(client: httpx.AsyncClient, rng: random.Random, mix: Mix, result: LoadResult, key: str = "", users: int = 0) -> None:
    api = rng.random()
    responses = api < mix.responses_share
    messages = not responses and api < mix.responses_share + mix.messages_share
    gemini = not (responses or messages) and api < mix.responses_share + mix.messages_share + mix.gemini_share
    ollama = not (responses or messages or gemini) and api < mix.responses_share + mix.messages_share + mix.gemini_share + mix.ollama_share
    chat = not (responses or messages or gemini or ollama) and rng.random() < mix.chat_share
    body: dict[str, object] = {"model": rng.choice(mix.models), "max_output_tokens" if responses else "max_tokens": rng.choice(mix.max_tokens),
                               "stream": rng.random() < mix.stream_share}
    text = _prompt(rng.choice(mix.prompt_tokens))
    if gemini:  # the path names the model and whether it streams
        model, stream, max_tokens = body.pop("model"), body.pop("stream"), body.pop("max_tokens")
        body = {"contents": [{"role": "user", "parts": [{"text": text}]}], "generationConfig": {"maxOutputTokens": max_tokens}}
    elif ollama:
        body["options"] = {"num_predict": body.pop("max_tokens")}
        body["messages"] = [{"role": "user", "content": text}]
    if responses:
        body["input"] = text
    elif chat or messages:
        body["messages"] = [{"role": "user", "content": text}]
    elif not (gemini or ollama):
        body["prompt"] = text
    headers = dict(mix.extra_headers)
    if key:
        headers["authorization"] = f"Bearer {key}"
        headers["x-api-key"] = key  # (Anthropic's header: the simulator takes either)
    if users:
        user = f"user-{rng.randrange(users)}"
        if messages:
            body["metadata"] = {"user_id": user}
        elif not (gemini or ollama):
            body["user"] = user
        else:
            headers["x-end-user"] = user
    prompt_tokens = len(text) // 4 if isinstance(text, str) else 0
    shape = rng.random()
    if shape < mix.cached_share:
        headers["x-sim-cached-tokens"] = str(prompt_tokens // 2)
    elif shape < mix.cached_share + mix.hidden_reasoning_share:
        headers["x-sim-hidden-reasoning"] = str(rng.choice(mix.max_tokens))
    if rng.random() < mix.error_share:
        headers["x-sim-error-status"] = rng.choice(("500", "429", "503"))
    result.sent += 1
    try:
        origin = str(client.base_url).rstrip("/").removesuffix("/v1")  # Gemini's and Ollama's paths are not under /v1
        path = ("/responses" if responses else "/messages" if messages else "/chat/completions" if chat else "/completions") if not (gemini or ollama) \
            else f"{origin}/api/chat" if ollama \
            else f"{origin}/v1beta/models/{model}:{'streamGenerateContent?alt=sse' if stream else 'generateContent'}"
        async with client.stream("POST", path, json=body, headers=headers) as r:
            async for _ in r.aiter_raw():
                pass
            result.statuses[r.status_code] += 1
    except httpx.HTTPError:
        result.failures += 1


async def run_load(base_url: str, concurrency: int = 4, duration_s: float = 10.0, requests: int | None = None,
                   mix: Mix | None = None, seed: int = 0, api_key: str = "load-test-key", keys: list[str] | None = None,
                   mixes: list[Mix] | None = None, users: int = 0) -> LoadResult:
    """`keys`: each request carries the next one (and with `mixes`, that key's mix); `users`: each
    request names one of this many end users."""
    mix = mix or Mix()
    result = LoadResult()
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits, headers={"authorization": f"Bearer {api_key}"}) as client:

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline and (requests is None or result.sent < requests):
                which = result.sent % len(keys) if keys else 0
                await _one(client, rng, mixes[which] if mixes else mix, result, keys[which] if keys else "", users)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return result
