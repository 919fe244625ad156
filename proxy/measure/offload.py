"""Work that must not run on the event loop: where it goes depends on whether it holds the GIL.

- Tokenizing releases the GIL (tiktoken's Rust core), so a thread keeps a long count off the loop;
  but each tiktoken call then retakes the GIL, and beside a busy event loop every handoff costs
  CPU that would be counted as tokenizer time. The prompt count, whose duration is the tokenize
  phase, runs inline when small and in the worker process when large; completion chunk counts
  (no phase) use the thread pool.
- Parsing JSON does not (orjson and the standard library hold the GIL for the whole document:
  measured, a thread parsing a 9 MB body stalls the loop for 320 ms). Bodies above
  `BIG_BODY_BYTES` are read in a one-process pool that sends back a small summary, never the
  parsed document (for a request: its small keys and its prompt as texts, counted at finish in the
  same worker). The worker starts with the proxy, in the background.
- Encoding OTLP spans holds the GIL too: the span processor's batches are encoded and sent from a
  second worker at the lowest CPU priority (export.py), so that telemetry never competes with
  the relay for a core.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, TypeVar

from .. import apis
from ..wire.chunk import BodyInfo
from ..wire.prompt import chain, media, sequence, tokens
from ..wire.tokens import PromptParts, Tokenizer

INLINE_TOKENIZE_BYTES = 16 * 1024  # about 4,000 tokens: well under a millisecond to count
INLINE_TOKENIZE_TEXTS = 256  # and at most this many texts (each a call: 60,000 empty messages took 50 ms)
BIG_BODY_BYTES = 1024 * 1024
# A body is parsed on the loop when its parse is short whatever it holds: up to LOOP_BODY_BYTES (the worst orjson does
# with them here: 8 ms, for 64,000 one-item lists), or up to BIG_BODY_BYTES with at most LOOP_VALUES commas (a coding
# agent's long conversation: prose, a few thousand); a body of many tiny values (token ids, empty messages) goes to the
# worker, whose parse stalls no stream.
LOOP_BODY_BYTES = 256 * 1024
LOOP_VALUES = 32_768
LOOP_COMPRESSED_BYTES = 32 * 1024  # a compressed response body read on the loop at most (gzip makes 10x of JSON, and more)
SMALL_KEYS = ("model", "stream", "stream_options", "n", "user", "safety_identifier", "metadata")  # (the last three: its end user, tenants.py)
T = TypeVar("T")


def summarize_request(path: str, body: bytes) -> tuple[dict[str, Any] | None, PromptParts | None]:
    """In the worker: (the request's small keys, its prompt as texts to count)."""
    route = apis.resolve(path)
    parsed = apis.parse_request(route, body)
    if parsed is None:
        return None, None
    view = {key: parsed[key] for key in SMALL_KEYS if key in parsed}
    view["_partial"] = True
    view["_media"] = inline = media(sequence(parsed))  # (its size's estimate: wire/prompt.py)
    view["_chain"] = chain(parsed, tokens(len(body), inline))  # (its replicas' prefix indexes read it: prefix.py)
    return view, route.dialect.prompt_parts(route.endpoint, parsed)


def on_loop(body: bytes) -> bool:
    """Whether a body is parsed on the event loop (the constants above say why)."""
    return len(body) <= LOOP_BODY_BYTES or (len(body) <= BIG_BODY_BYTES and body.count(b",") <= LOOP_VALUES)


_worker_tokenizer: Tokenizer | None = None  # in the worker process only, made at its first count


def count_texts(model: str, texts: list[str], default_encoding: str) -> tuple[list[int], float]:
    """In the worker: each text's tokens, timed with no event loop competing for the GIL."""
    global _worker_tokenizer
    if _worker_tokenizer is None:
        _worker_tokenizer = Tokenizer(default_encoding)
    return _worker_tokenizer.timed_counts(model, texts)


def _ready() -> bool:
    return True


def _die_with_parent() -> None:
    """Worker initializer: if the proxy is killed, the kernel ends its worker too (Linux)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the pool's own shutdown is the only way out


def _background_worker() -> None:
    _die_with_parent()
    try:
        import os

        os.nice(19)
    except (OSError, AttributeError):
        pass


def summarize_response(api: str, parts: list[bytes], encoding: bytes) -> BodyInfo:
    """In the worker: what a JSON response says; its text only when it has no usage to count from."""
    info = apis.read_json_body(api, b"".join(parts), encoding)
    return info._replace(text="") if info.usage else info


def _spawn(initializer: Callable[[], None]) -> ProcessPoolExecutor:
    """A one-process pool, started by spawn (a fork would copy the event loop and its threads)."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=initializer)


class Offload:
    def __init__(self, threads: int = 2) -> None:
        self.threads: Executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llmproxy-offload")
        self._process: ProcessPoolExecutor | None = None
        self._background: ProcessPoolExecutor | None = None

    async def thread(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= INLINE_TOKENIZE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    async def counts(self, tokenizer: Tokenizer, model: str, texts: list[str]) -> tuple[list[int], float]:
        """Prompt parts to count: a few KB inline, more in the worker, where the CPU time is the tokenizer's own."""
        if len(texts) <= INLINE_TOKENIZE_TEXTS and sum(map(len, texts)) <= INLINE_TOKENIZE_BYTES:
            return tokenizer.timed_counts(model, texts)
        return await self.process(count_texts, model, texts, tokenizer.default_encoding)

    async def process(self, fn: Callable[..., T], *args: Any) -> T:
        if self._process is None:
            self.start_worker()
        assert self._process is not None
        return await asyncio.get_running_loop().run_in_executor(self._process, fn, *args)

    def submit_background(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """From any thread (the span processor's): run `fn` in the background worker, a second
        process at the lowest CPU priority (nice 19), so telemetry export takes only CPU the relay,
        and on a shared machine the engine, leave idle. A crashed worker is replaced."""
        for attempt in (1, 2):
            if self._background is None:
                self._background = _spawn(_background_worker)
            try:
                return self._background.submit(fn, *args)
            except BrokenProcessPool:
                if attempt == 2:
                    raise
                self._background = None
        raise AssertionError("unreachable")

    def start_worker(self) -> None:
        """Start the worker process now, in the background (about 0.3 s of CPU, ~27 MB; ~100 MB once
        it has loaded a BPE table), so the first big body does not wait for an interpreter to start."""
        self._process = self._process or _spawn(_die_with_parent)
        self._process.submit(_ready)

    async def request(self, route: apis.Route, path: str, body: bytes) -> tuple[dict[str, Any] | None, PromptParts | None]:
        """(parsed body or its small keys, the prompt's parts when read in the worker)."""
        if not route.timed or on_loop(body):  # (unmeasured paths, file uploads among them, are never parsed)
            return apis.parse_request(route, body), None
        return await self.process(summarize_request, path, body)

    async def response(self, api: str, parts: list[bytes] | None, encoding: bytes) -> BodyInfo:
        if not parts:
            return BodyInfo()
        body = b"".join(parts)
        # (a compressed body's size says little of what it holds: on the loop only when small)
        if on_loop(body) if encoding.strip().lower() in (b"", b"identity") else len(body) <= LOOP_COMPRESSED_BYTES:
            return apis.read_json_body(api, body, encoding)
        return await self.process(summarize_response, api, [body], encoding)

    def shutdown(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        for pool in (self._process, self._background):  # waited for: an idle worker exits at once, none is left behind
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._process = self._background = None
