"""Work that must not run on the event loop: where it goes depends on whether it holds the GIL.

- Tokenizing releases the GIL (tiktoken's Rust core): small inputs run inline (cheaper than a
  thread hop), large ones in a thread pool.
- Parsing JSON does not (orjson and the standard library hold the GIL for the whole document:
  measured, a thread parsing a 9 MB body stalls the loop for 320 ms). Bodies above
  `BIG_BODY_BYTES` are read in a one-process pool that sends back a small summary, never the
  parsed document. The pool starts at the first big body.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import orjson

from .chunk import BodyInfo, read_json_body
from .request import parse_request

INLINE_TOKENIZE_BYTES = 16 * 1024  # about 4,000 tokens: well under a millisecond to count
BIG_BODY_BYTES = 1024 * 1024
SMALL_KEYS = ("model", "stream", "stream_options", "n")
T = TypeVar("T")

_worker_tokenizer: Any = None  # in the worker process only: loaded at its first count


def summarize_request(path: str, body: bytes, encoding: str | None) -> tuple[str, dict[str, Any] | None, tuple[int, int, float] | None]:
    """In the worker: (endpoint, the request's small keys, (prompt tokens, uncounted, seconds))."""
    global _worker_tokenizer
    endpoint, parsed = parse_request(path, body)
    if parsed is None:
        return endpoint, None, None
    view = {key: parsed[key] for key in SMALL_KEYS if key in parsed}
    view["_partial"] = True
    count = None
    if encoding is not None:
        if _worker_tokenizer is None:
            from .tokens import Tokenizer

            _worker_tokenizer = Tokenizer(encoding)
        count = _worker_tokenizer.timed_prompt_count(endpoint, parsed)
    return endpoint, view, count


def summarize_response(parts: list[bytes], encoding: bytes) -> BodyInfo:
    """In the worker: what a JSON response says; its text only when it has no usage to count from."""
    info = read_json_body(b"".join(parts), encoding)
    return info._replace(text="") if info.usage else info


class Offload:
    def __init__(self, threads: int = 2) -> None:
        self.threads: Executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llmproxy-offload")
        self._process: ProcessPoolExecutor | None = None

    async def thread(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= INLINE_TOKENIZE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    async def process(self, fn: Callable[..., T], *args: Any) -> T:
        if self._process is None:
            self._process = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return await asyncio.get_running_loop().run_in_executor(self._process, fn, *args)

    async def request(self, path: str, body: bytes, encoding: str | None) -> tuple[str, dict[str, Any] | None, tuple[int, int, float] | None]:
        if len(body) <= BIG_BODY_BYTES:
            endpoint, parsed = parse_request(path, body)
            return endpoint, parsed, None
        return await self.process(summarize_request, path, body, encoding)

    async def response(self, parts: list[bytes] | None, encoding: bytes) -> BodyInfo:
        if not parts:
            return BodyInfo()
        if sum(map(len, parts)) <= BIG_BODY_BYTES:
            return read_json_body(b"".join(parts), encoding)
        return await self.process(summarize_response, parts, encoding)

    def shutdown(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)


