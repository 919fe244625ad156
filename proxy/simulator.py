"""A built-in OpenAI-compatible upstream that behaves like an inference engine, on a known schedule.

TTFT = prompt tokens / prefill tokens-per-second (the seed's Prefill(L_in)); then tokens stream at
the decode rate, token k at TTFT + k / decode_tps after the request arrived (anchored, so sleep
jitter never accumulates). A role-only chunk goes out at once, as OpenAI sends it, so a proxy that
counted it as the first token would be caught. Per-request overrides come as `x-sim-*` headers;
`POST /sim/config` changes defaults at run time; `GET /sim/stats` says what the simulator saw
(requests, completed streams, client disconnects), so tests can observe a close from the far side.
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import orjson

from .tokens import Tokenizer

# Each is one token in cl100k_base and o200k_base, so chunk text and token counts agree.
WORDS = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on")
FIXED_CREATED = 1_700_000_000


@dataclass
class SimConfig:
    prefill_tps: float = 5000.0
    ttft_ms: float = -1.0  # >= 0: a fixed TTFT instead of prompt tokens / prefill_tps
    decode_tps: float = 100.0
    jitter: float = 0.0  # each inter-token gap scaled by uniform(1 - jitter, 1 + jitter)
    chunk_tokens: int = 1  # tokens per content chunk
    default_max_tokens: int = 100
    role_chunk: bool = True
    usage_null_chunks: bool = True  # with include_usage, every chunk carries "usage": null (OpenAI)
    deterministic: bool = False  # fixed `created`, for byte comparisons
    seed: int = 0


class SimStats:
    def __init__(self) -> None:
        self.requests = 0
        self.completed = 0
        self.disconnects = 0
        self.tokens_sent = 0
        self.last_headers: dict[str, str] = {}
        self.last_body: dict[str, Any] = {}

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "completed": self.completed, "disconnects": self.disconnects, "tokens_sent": self.tokens_sent,
                "last_headers": self.last_headers, "last_body": self.last_body}


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
        self.rng = random.Random(self.config.seed)

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
            return await self._reply(send, _json_response(200, asdict(self.config)))
        if path in ("/health", "/healthz"):
            return await self._reply(send, _json_response(200, {"status": "ok"}))
        if path == "/v1/models":
            return await self._reply(send, _json_response(200, {"object": "list", "data": [{"id": "sim-7b", "object": "model", "created": FIXED_CREATED, "owned_by": "simulator"}]}))
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}.get(path)
        if kind is None:
            return await self._reply(send, _json_response(404, {"error": {"message": f"no route {path}", "type": "invalid_request_error", "code": "not_found", "param": None}}))
        self.stats.requests += 1
        self.stats.last_headers = headers
        try:
            request = orjson.loads(body)
            assert isinstance(request, dict)
        except (orjson.JSONDecodeError, AssertionError):
            return await self._reply(send, _json_response(400, {"error": {"message": "invalid JSON body", "type": "invalid_request_error", "code": "invalid_json", "param": None}}))
        self.stats.last_body = request
        status = int(headers.get("x-sim-error-status", "0") or 0)
        if status:
            extra = [(b"retry-after", headers["x-sim-retry-after"].encode())] if "x-sim-retry-after" in headers else []
            error = {"error": {"message": f"simulated error {status}", "type": "simulated_error", "code": str(status), "param": None}}
            return await self._reply(send, _json_response(status, error, extra))
        if kind == "embeddings":
            return await self._embeddings(send, request)
        await self._generate(scope, receive, send, kind, request, headers, received)

    async def _reply(self, send: Any, response: tuple[int, list[tuple[bytes, bytes]], bytes]) -> None:
        status, headers, body = response
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _embeddings(self, send: Any, request: dict[str, Any]) -> None:
        inputs = request.get("input")
        items = inputs if isinstance(inputs, list) and not all(isinstance(x, int) for x in inputs) else [inputs]
        tokens = self.tokenizer.count_prompt("embeddings", request)
        data = [{"object": "embedding", "index": i, "embedding": [round(0.01 * (i + j), 4) for j in range(8)]} for i in range(len(items))]
        await self._reply(send, _json_response(200, {"object": "list", "data": data, "model": request.get("model", ""), "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))

    def _schedule(self, prompt_tokens: int, n: int, headers: dict[str, str]) -> list[float]:
        """Seconds after arrival at which each of the n tokens is ready."""
        cfg = self.config
        if "x-sim-ttft-ms" in headers:
            ttft = float(headers["x-sim-ttft-ms"]) / 1000
        else:
            ttft = cfg.ttft_ms / 1000 if cfg.ttft_ms >= 0 else prompt_tokens / cfg.prefill_tps
        gap = 1.0 / float(headers.get("x-sim-decode-tps", cfg.decode_tps))
        times, at = [], ttft
        for k in range(n):
            if k:
                at += gap * (self.rng.uniform(1 - cfg.jitter, 1 + cfg.jitter) if cfg.jitter else 1.0)
            times.append(at)
        return times

    async def _generate(self, scope: dict[str, Any], receive: Any, send: Any, kind: str, request: dict[str, Any], headers: dict[str, str], received: float) -> None:
        cfg = self.config
        model = str(request.get("model") or "sim-7b")
        n = int(request.get("max_tokens") or request.get("max_completion_tokens") or cfg.default_max_tokens)
        prompt_tokens = self.tokenizer.count_prompt(kind, request)
        times = self._schedule(prompt_tokens, n, headers)
        digest = hashlib.sha1(orjson.dumps([model, request.get("messages"), request.get("prompt"), n])).hexdigest()[:24]
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + digest
        created = FIXED_CREATED if cfg.deterministic else int(time.time())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        text = [WORDS[k % len(WORDS)] for k in range(n)]
        stream = request.get("stream") is True
        options = request.get("stream_options") or {}
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        task = asyncio.current_task()
        gone: list[bool] = []
        watcher = asyncio.create_task(self._watch(receive, task, gone))  # sees the client leave, any time
        try:
            if stream:
                await self._stream(send, kind, ident, created, model, text, times, received, usage, include_usage, headers)
            else:
                await self._complete(send, kind, ident, created, model, text, times, received, usage)
        except asyncio.CancelledError:
            if not gone or task is None:
                raise
            task.uncancel()
            self.stats.disconnects += 1
        finally:
            watcher.cancel()

    async def _complete(self, send: Any, kind: str, ident: str, created: int, model: str, text: list[str],
                        times: list[float], received: float, usage: dict[str, int]) -> None:
        if times:
            await asyncio.sleep(max(0.0, received + times[-1] - time.monotonic()))
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "logprobs": None, "finish_reason": "length"}
            obj = {"id": ident, "object": "chat.completion", "created": created, "model": model, "choices": [choice], "usage": usage}
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": "length"}
            obj = {"id": ident, "object": "text_completion", "created": created, "model": model, "choices": [choice], "usage": usage}
        self.stats.completed += 1
        await self._reply(send, _json_response(200, obj))

    async def _watch(self, receive: Any, task: asyncio.Task[Any] | None, gone: list[bool]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if task is not None:
                    gone.append(True)
                    task.cancel()
                return

    async def _stream(self, send: Any, kind: str, ident: str, created: int, model: str, text: list[str], times: list[float],
                      received: float, usage: dict[str, int], include_usage: bool, headers: dict[str, str]) -> None:
        cfg = self.config
        obj_name = "chat.completion.chunk" if kind == "chat" else "text_completion"
        null_usage = include_usage and cfg.usage_null_chunks

        def event(choices: list[dict[str, Any]], usage_value: Any = None, with_usage: bool = False) -> bytes:
            obj: dict[str, Any] = {"id": ident, "object": obj_name, "created": created, "model": model, "choices": choices}
            if with_usage or null_usage:
                obj["usage"] = usage_value
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        def choice(content: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": content} if content is not None else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}

        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
        if cfg.role_chunk and kind == "chat":
            await send({"type": "http.response.body", "body": event([choice(None, None, role=True)]), "more_body": True})
        drop_after = int(headers.get("x-sim-drop-after", "-1"))
        stall_after = int(headers.get("x-sim-stall-after", "-1"))
        malformed = headers.get("x-sim-malformed") == "1"
        padding = " " * int(headers.get("x-sim-token-bytes", "0"))
        per_chunk = max(1, int(headers.get("x-sim-chunk-tokens", cfg.chunk_tokens)))
        for start in range(0, len(text), per_chunk):
            if 0 <= drop_after <= start:
                return  # leave the response incomplete: uvicorn closes the connection mid-stream
            if 0 <= stall_after <= start:
                await asyncio.Event().wait()  # silent forever (until the client leaves)
            end = min(len(text), start + per_chunk)
            await asyncio.sleep(max(0.0, received + times[end - 1] - time.monotonic()))
            await send({"type": "http.response.body", "body": event([choice("".join(text[start:end]) + padding, None)]), "more_body": True})
            self.stats.tokens_sent += end - start
            if malformed and start == 0:
                await send({"type": "http.response.body", "body": b'data: {"choices": [{"delta": {"content": "unterminated\n\n', "more_body": True})
        tail = event([choice(None, "length")])
        if include_usage:
            tail += event([], usage, with_usage=True)
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        self.stats.completed += 1
