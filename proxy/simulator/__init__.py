"""The simulated world `make demo`, the tests and the benchmarks run in: the clients (load.py: a traffic mix;
sessions.py: coding agents' conversations) and a built-in upstream that behaves like an inference engine, on a known schedule, and speaks every
API the proxy measures, one module each as the proxy has them (`openai.py`: chat and completions,
`responses.py`: the Responses API, `anthropic.py`: Messages); Azure OpenAI's paths are served as chat.

TTFT = prompt tokens / prefill tokens-per-second (the seed's Prefill(L_in)); then tokens stream at
the decode rate, token k at TTFT + k / decode_tps after the request arrived (anchored, so sleep
jitter never accumulates). A role-only chunk goes out at once, as OpenAI sends it, so a proxy that
counted it as the first token would be caught. Per-request overrides come as `x-sim-*` headers;
`POST /sim/config` changes defaults at run time; `GET /sim/stats` says what the simulator saw
(requests, completed streams, client disconnects, when each content chunk of the last stream was
sent), so tests can observe a close from the far side and time stamps against what was sent. With
`batch_alpha_ms` / `batch_beta_ms` (flags `--batch-alpha-ms`, `--batch-beta-ms`, or `/sim/config`)
chat and completions streams follow continuous batching's law: time per token = alpha + beta x the
streams decoding at once.

Production shapes, per request (STREAMS.md lists what real servers send):
`x-sim-hidden-reasoning: N` (N reasoning tokens generated before the first visible one, never
streamed, reported in usage.completion_tokens_details), `x-sim-visible-reasoning: N` with
`x-sim-reasoning-field: reasoning_content | reasoning | both`, the request's `n` (choices
interleaved), `x-sim-chunk-pattern: 4,4,2` (tokens per chunk, cycled), `x-sim-cached-tokens: N`
(prefill on the rest only; usage.prompt_tokens_details), `x-sim-queue-ms`, `x-sim-keepalive-ms: K`
(`: keep-alive` comments before the first token), `x-sim-reject-stream-options: 1` (400, as older
Azure api-versions), `x-sim-vllm-metrics: 1` (vLLM's per-request `metrics`), `x-sim-tgi-headers: 1`,
`x-sim-delta-field: refusal | function_call`, `x-sim-body-bytes: N` (pads a non-streaming body),
`x-sim-drop-body: 1` (a non-streaming body cut in half), `x-sim-event-bytes: N` (each streamed
chat chunk carries `logprobs` with `top_logprobs`, about N bytes: the big events of a slow reader's
test), `x-sim-done-gap-ms` (the stream ends a while
after `[DONE]`), `x-sim-logprobs: N` (N logprobs entries in a
non-streaming body: parse-heavy JSON). `POST /v1/responses` (the Responses API, `responses.py`)
follows the same schedule and headers (`max_output_tokens`; reasoning as `reasoning_text`, or
`summary` with `x-sim-reasoning-field: summary`; `x-sim-delta-field: function_call` streams a call's
arguments), and so does `POST /v1/messages` (`anthropic.py`). For any API:
`x-sim-content-encoding: gzip | deflate | br | zstd` (each write compressed and flushed, as CDNs
send it; `x-sim-corrupt-encoding: 1` sends bytes that are not what the header says) and
`x-sim-endless-event-bytes: N` (a hostile stream: one data line that never ends, N more bytes every
`x-sim-endless-every-ms`, default 20). With `--prefix-cache-tokens N` (or `/sim/config`), a prefix cache
(cache.py) serves the prompts it has seen: prefill on the uncached rest only, cached tokens reported as each
API reports them; `GET /sim/stats` counts prompt and cached tokens.
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import time
from dataclasses import asdict, fields
from typing import Any

import orjson

from .. import apis
from ..wire.chunk import json_object
from ..wire.text import dumps, storable
from ..wire.tokens import Tokenizer
from . import anthropic, gemini, ollama, openai, responses
from .cache import PrefixCache
from .compression import encoded
from .schedule import Plan, SimConfig, SimStats

# Each is one token in cl100k_base and o200k_base, so chunk text and token counts agree.
WORDS = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on")
FIXED_CREATED = 1_700_000_000




async def _endless(send: Any, size: int, every: float) -> None:
    """A hostile upstream: one SSE data line that never ends, `size` more bytes every `every` seconds."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"data: ", "more_body": True})
    piece = b"A" * size
    while True:
        await asyncio.sleep(every)
        await send({"type": "http.response.body", "body": piece, "more_body": True})


def _json_response(status: int, obj: Any, extra: list[tuple[bytes, bytes]] | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = orjson.dumps(obj)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, headers + (extra or []), body


class Simulator:
    """The ASGI app."""

    def __init__(self, config: SimConfig | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.config = config or SimConfig()
        self.tokenizer = tokenizer or Tokenizer()
        self.stats = SimStats()
        self.generating = 0  # generation requests in flight (`max_streams`)
        self.decoding = 0  # streams between their first and last token now (the batching law's batch)
        self.prefill_free_at = 0.0  # with prefill_queue: when the prefill unit is free (monotonic s)
        self.rng = random.Random(self.config.seed)
        self.cache = PrefixCache(self.config.prefix_cache_tokens)
        self._big: dict[tuple[Any, ...], bytes] = {}  # serialised parse-heavy bodies (x-sim-logprobs)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.tokenizer.preload()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        received = time.monotonic()
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path, method = scope["path"], scope["method"]
        if path == "/sim/stats":
            return await self._reply(send, _json_response(200, self.stats.as_dict()))
        if path == "/sim/config" and method == "POST":
            for key, value in orjson.loads(body or b"{}").items():
                if key in {f.name for f in fields(SimConfig)}:
                    setattr(self.config, key, type(getattr(self.config, key))(value))
                    if key == "prefix_cache_tokens":
                        self.cache.clear()  # (a test's cold start)
            return await self._reply(send, _json_response(200, asdict(self.config)))
        if self.config.wedged:  # (accepted, never answered: until the client leaves)
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        if path == "/metrics":  # (vLLM's queue gauges: what every proxy in front of it sent)
            text = (f'vllm:num_requests_running{{model_name="sim-7b"}} {float(self.generating)}\n'
                    f'vllm:num_requests_waiting{{model_name="sim-7b"}} 0.0\n').encode()
            return await self._reply(send, (200, [(b"content-type", b"text/plain; version=0.0.4")], text))
        if path in ("/health", "/healthz"):  # (a crashed engine's fails: vLLM's /health asks the engine)
            status = self.config.error_status if self.config.error_status >= 500 else 200
            return await self._reply(send, _json_response(status, {"status": "ok" if status == 200 else "engine dead"}))
        if path == "/v1/models":
            return await self._reply(send, _json_response(200, {"object": "list", "data": [{"id": "sim-7b", "object": "model", "created": FIXED_CREATED, "owned_by": "simulator"}]}))
        if path == "/api/tags":
            return await self._reply(send, _json_response(200, ollama.TAGS))
        query = scope.get("query_string", b"")
        route = apis.resolve(path, query)  # every path the proxy measures (Azure's, Gemini's, Ollama's), read as the proxy reads it
        kind = "count_tokens" if path == "/v1/messages/count_tokens" else (route.endpoint if route.timed else None)
        if kind is None:
            return await self._reply(send, _json_response(404, {"error": {"message": f"no route {path}", "type": "invalid_request_error", "code": "not_found", "param": None}}))
        self.stats.requests += 1
        self.stats.last_headers = headers
        # A simulated error is answered before the body is parsed, as an engine refuses what it will not serve
        # (an over-long prompt, a full queue) cheaply: a benchmark's hostile body costs the simulator no parse.
        status = int(headers.get("x-sim-error-status", "0") or 0) or self.config.error_status
        if not status and 0 < self.config.max_streams <= self.generating:
            status = 429  # (full: a fifth request on an engine of four slots)
        if status:
            retry_after = headers.get("x-sim-retry-after", self.config.retry_after)
            extra = [(b"retry-after", retry_after.encode())] if retry_after else []
            error = {"error": {"message": f"simulated error {status}", "type": "simulated_error", "code": str(status), "param": None}}
            return await self._reply(send, _json_response(status, error, extra))
        request = json_object(body)  # (as an engine reads it: Python's json where orjson refuses, chunk.py)
        if request is None:
            return await self._reply(send, _json_response(400, {"error": {"message": "invalid JSON body", "type": "invalid_request_error", "code": "invalid_json", "param": None}}))
        self.stats.last_body = request
        send = encoded(send, headers)  # x-sim-content-encoding: the body compressed, read by read
        if kind == "embeddings":
            return await self._embeddings(send, request)
        if kind == "ollama_embed":
            tokens = self.tokenizer.count_parts(ollama.prompt_parts(kind, request))
            return await self._reply(send, _json_response(200, ollama.embed(request, tokens, float(headers.get("x-sim-load-ms", "0")) / 1000)))
        if route.model and not request.get("model"):  # (Gemini: the path names the model and whether it streams)
            request["model"] = route.model
        if route.stream is not None:
            request["stream"] = route.stream
        elif kind.startswith("ollama_") and "stream" not in request:
            request["stream"] = True  # Ollama streams unless told not to
        if kind == "generate_content":
            headers["x-sim-framing"] = route.framing
        if kind == "count_tokens":
            tokens = self.tokenizer.count_parts(anthropic.prompt_parts("messages", request))
            return await self._reply(send, _json_response(200, {"input_tokens": tokens}))
        self.generating += 1
        try:
            await self._generate(scope, receive, send, kind, request, headers, received)
        finally:
            self.generating -= 1

    async def _reply(self, send: Any, response: tuple[int, list[tuple[bytes, bytes]], bytes]) -> None:
        status, headers, body = response
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _embeddings(self, send: Any, request: dict[str, Any]) -> None:
        inputs = request.get("input")
        items = inputs if isinstance(inputs, list) and not all(isinstance(x, int) for x in inputs) else [inputs]
        tokens = self.tokenizer.count_parts(openai.prompt_parts("embeddings", request))
        data = [{"object": "embedding", "index": i, "embedding": [round(0.01 * (i + j), 4) for j in range(8)]} for i in range(len(items))]
        await self._reply(send, _json_response(200, {"object": "list", "data": data, "model": request.get("model", ""), "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))

    def _plan(self, prompt_tokens: int, request: dict[str, Any], headers: dict[str, str], texts: list[str] | None = None) -> "Plan":
        """When each chunk of each choice is ready, in seconds after arrival."""
        cfg = self.config
        caching = cfg.prefix_cache_tokens > 0 and texts is not None and "x-sim-cached-tokens" not in headers
        if caching:
            self.cache.capacity = cfg.prefix_cache_tokens
            cached = self.cache.serve(texts or [], prompt_tokens)
        else:
            cached = min(prompt_tokens, int(headers.get("x-sim-cached-tokens", "0")))
        self.stats.prompt_tokens += prompt_tokens
        self.stats.cached_tokens += cached
        load = float(headers.get("x-sim-load-ms", "0")) / 1000  # a cold model load (Ollama reports it), before prefill
        queue = float(headers.get("x-sim-queue-ms", "0")) / 1000 + load
        if "x-sim-ttft-ms" in headers:
            prefill = float(headers["x-sim-ttft-ms"]) / 1000
        else:
            prefill = cfg.ttft_ms / 1000 if cfg.ttft_ms >= 0 else (prompt_tokens - cached) / cfg.prefill_tps
        gap = 1.0 / float(headers.get("x-sim-decode-tps", cfg.decode_tps))
        hidden = int(headers.get("x-sim-hidden-reasoning", "0"))
        visible_reasoning = int(headers.get("x-sim-visible-reasoning", "0"))
        limits = (request.get("generationConfig") or {}).get("maxOutputTokens") or (request.get("options") or {}).get("num_predict")
        n = int(request.get("max_tokens") or request.get("max_completion_tokens") or request.get("max_output_tokens") or limits or cfg.default_max_tokens)
        choices = max(1, int(request.get("n") or 1))
        pattern = [max(1, int(x)) for x in headers.get("x-sim-chunk-pattern", str(headers.get("x-sim-chunk-tokens", cfg.chunk_tokens))).split(",")]
        if cfg.prefill_queue:  # wait for the prefill work sent before this request (`received`: now)
            now = time.monotonic()
            begins = max(now + queue, self.prefill_free_at)
            self.prefill_free_at = begins + prefill
            queue = begins - now
        start = queue + prefill + hidden * gap  # hidden reasoning: generated, never streamed
        chunks: list[tuple[float, int, str, list[str]]] = []  # (ready at, choice, field, tokens)
        for choice in range(choices):
            offset = choice * gap / choices  # sequences of one batch, interleaved
            slots = [("reasoning", WORDS[k % len(WORDS)]) for k in range(visible_reasoning)] + [("content", WORDS[k % len(WORDS)]) for k in range(n)]
            ready, at = [], start + offset
            for j in range(len(slots)):  # anchored to arrival, so sleep jitter never accumulates
                if j:
                    at += gap * (self.rng.uniform(1 - cfg.jitter, 1 + cfg.jitter) if cfg.jitter else 1.0)
                ready.append(at)
            position, k = 0, 0
            while position < len(slots):
                size = pattern[k % len(pattern)]
                group = slots[position:position + size]
                kinds = {kind for kind, _ in group}
                if len(kinds) > 1:  # never mix reasoning and content in one delta
                    group = [slot for slot in group if slot[0] == group[0][0]]
                position += len(group)
                chunks.append((ready[position - 1], choice, group[0][0], [word for _, word in group]))
                k += 1
        chunks.sort(key=lambda c: (c[0], c[1]))
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": choices * (n + hidden + visible_reasoning),
                                 "total_tokens": prompt_tokens + choices * (n + hidden + visible_reasoning)}
        if cached or caching or "x-sim-cached-tokens" in headers:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if hidden:
            usage["completion_tokens_details"] = {"reasoning_tokens": choices * hidden}
        return Plan(chunks, usage, queue, queue + prefill, gap, choices, choices * hidden, choices * (hidden + visible_reasoning), load)

    async def _generate(self, scope: dict[str, Any], receive: Any, send: Any, kind: str, request: dict[str, Any], headers: dict[str, str], received: float) -> None:
        cfg = self.config
        self.stats.last_received = received
        model = storable(str(request.get("model") or "sim-7b"), 1024)  # (echoed in every chunk: a lone surrogate is no UTF-8)
        if headers.get("x-sim-reject-stream-options") == "1" and "stream_options" in request:
            error = {"error": {"message": "Unrecognized request argument supplied: stream_options", "type": "invalid_request_error", "param": None, "code": None}}
            return await self._reply(send, _json_response(400, error))
        api = {"messages": anthropic, "generate_content": gemini, "ollama_chat": ollama, "ollama_generate": ollama}.get(kind, openai)
        parts = api.prompt_parts(kind, request)
        tokens = self.tokenizer.count_parts(parts)
        if 0 < cfg.error_over_tokens < tokens:
            error = {"error": {"message": f"simulated failure on a prompt of {tokens} tokens", "type": "simulated_error", "code": "500", "param": None}}
            return await self._reply(send, _json_response(500, error))
        plan = self._plan(tokens, request, headers, parts.texts)
        digest = hashlib.sha1(dumps([model, request.get("messages"), request.get("prompt"), request.get("max_tokens")])).hexdigest()[:24]
        ident = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}.get(kind, "cmpl-") + digest
        created = FIXED_CREATED if cfg.deterministic else int(time.time())
        stream = request.get("stream") is True
        task = asyncio.current_task()
        gone: list[bool] = []
        watcher = asyncio.create_task(self._watch(receive, task, gone))  # sees the client leave, any time
        try:
            endless = int(headers.get("x-sim-endless-event-bytes", "0"))
            if endless and stream:
                await _endless(send, endless, float(headers.get("x-sim-endless-every-ms", "20")) / 1000)
            elif kind in ("responses", "messages", "generate_content", "ollama_chat", "ollama_generate") and stream:
                times = self.stats.last_send_times = []
                if kind == "responses":
                    self.stats.tokens_sent += await responses.stream(send, plan, received, ident, created, model, headers, times)
                elif kind == "messages":
                    self.stats.tokens_sent += await anthropic.stream(send, plan, received, ident, model, headers, times)
                elif kind == "generate_content":
                    self.stats.tokens_sent += await gemini.stream(send, plan, received, ident, model, headers, headers["x-sim-framing"] == "sse", times)
                else:
                    self.stats.tokens_sent += await ollama.stream(send, kind, plan, received, model, headers, times)
                self.stats.completed += 1
            elif stream:
                await openai.stream(self, send, kind, ident, created, model, plan, received, request, headers)
            else:
                await self._complete(send, kind, ident, created, model, plan, received, headers)
        except asyncio.CancelledError:
            if not gone or task is None:
                raise
            task.uncancel()
            self.stats.disconnects += 1
        finally:
            watcher.cancel()

    async def _complete(self, send: Any, kind: str, ident: str, created: int, model: str, plan: "Plan", received: float,
                        headers: dict[str, str]) -> None:
        await asyncio.sleep(max(0.0, received + plan.end - time.monotonic()))
        padding = " " * int(headers.get("x-sim-body-bytes", "0"))
        if kind == "responses":
            obj = responses.body(plan, ident, created, model, headers)
        elif kind == "messages":
            obj = anthropic.body(plan, ident, model, headers)
        elif kind == "generate_content":
            obj = gemini.body(plan, ident, model)
        elif kind in ("ollama_chat", "ollama_generate"):
            obj = ollama.body(kind, plan, model)
        else:
            obj = openai.body(kind, plan, ident, created, model, padding)
        choices: list[dict[str, Any]] = obj.get("choices", [])
        extra: list[tuple[bytes, bytes]] = []
        if headers.get("x-sim-vllm-metrics") == "1":
            obj["metrics"] = plan.vllm_metrics()
        if headers.get("x-sim-tgi-headers") == "1":
            generated = plan.usage["completion_tokens"]
            inference_ms = (plan.end - plan.queue) * 1000
            extra = [(b"x-queue-time", str(int(plan.queue * 1000)).encode()), (b"x-inference-time", str(int(inference_ms)).encode()),
                     (b"x-time-per-token", str(int(inference_ms / max(1, generated))).encode()),
                     (b"x-prompt-tokens", str(plan.usage["prompt_tokens"]).encode()), (b"x-generated-tokens", str(generated).encode())]
        logprobs = int(headers.get("x-sim-logprobs", "0"))
        if logprobs:  # a parse-heavy body: one logprobs entry per "token", as OpenAI's logprobs=true sends
            key = (kind, model, logprobs, len(padding), plan.choices)
            body = self._big.get(key)
            if body is None:
                entry: dict[str, Any] = {"token": " the", "logprob": -0.125, "bytes": [32, 116, 104, 101], "top_logprobs": []}
                for choice in choices:
                    choice["logprobs"] = {"content": [entry] * logprobs}
                body = self._big[key] = orjson.dumps(obj)  # serialised once: the simulator's own stall stays small
            status, response_headers = 200, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + extra
        else:
            status, response_headers, body = _json_response(200, obj, extra)
        if headers.get("x-sim-drop-body") == "1":  # headers and half the body, then the connection closes
            await send({"type": "http.response.start", "status": status, "headers": response_headers})
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            return
        self.stats.completed += 1
        await self._reply(send, (status, response_headers, body))

    async def _watch(self, receive: Any, task: asyncio.Task[Any] | None, gone: list[bool]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if task is not None:
                    gone.append(True)
                    task.cancel()
                return
