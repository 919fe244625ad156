"""Work kept off the event loop: big bodies read in the worker process, prompt counts timed honestly."""
from __future__ import annotations

import asyncio
import threading

import orjson

from proxy import apis
from proxy.wire import prompt
from proxy.measure.offload import BIG_BODY_BYTES, Offload
from proxy.apis.openai import prompt_parts
from proxy.wire.tokens import Tokenizer


def test_a_large_prompt_is_counted_in_the_worker_with_the_tokenizers_own_time():
    """Beside a thread that keeps the GIL busy (as a busy event loop does), the tokenize phase is
    still the tokenizer's CPU time: in a thread, each tiktoken call's GIL handoff would be counted."""
    tok = Tokenizer()
    tok.preload()
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": f"message {i} " + "word " * 20} for i in range(3000)]}
    parts = prompt_parts("chat", body)
    alone = min(tok.timed_prompt_count(parts)[2] for _ in range(3))
    offload = Offload()
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=busy)
    try:
        asyncio.run(offload.counts(tok, parts.model, parts.texts))  # the worker loads its BPE tables (not timed)
        spinner.start()
        counts, seconds = asyncio.run(offload.counts(tok, parts.model, parts.texts))
        count, uncounted = parts.fixed + sum(counts), parts.uncounted
    finally:
        stop.set()
        offload.shutdown()
    assert count == tok.count_parts(parts) and uncounted == 0
    assert seconds < 3 * alone + 0.005, (seconds, alone)


def test_a_big_request_body_is_summarised_in_the_worker():
    body = orjson.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": 1},
                         "messages": [{"role": "user", "content": "x " * BIG_BODY_BYTES}]})
    offload = Offload()
    try:
        view, parts = asyncio.run(offload.request(apis.resolve("/v1/chat/completions"), "/v1/chat/completions", body))
        small = asyncio.run(offload.request(apis.resolve("/v1/files"), "/v1/files", body))  # an unmeasured path is never parsed
    finally:
        offload.shutdown()
    chain = view.pop("_chain")  # its prompt as the replicas' prefix indexes see it (prefix.py), made in the worker too
    assert view == {"model": "m", "stream": True, "stream_options": {"include_usage": 1}, "_partial": True, "_media": (0, 0)}
    assert chain is not None and len(chain.hashes) == 1 and chain == prompt.chain(orjson.loads(body), len(body) // 4)  # the same as here
    assert BIG_BODY_BYTES * 2 // 4 <= chain.total < (BIG_BODY_BYTES * 2 + 64) // 4  # (its size: the text's bytes / 4)
    assert parts is not None and parts.texts == ["user", "x " * BIG_BODY_BYTES] and parts.fixed == 3 + 3
    assert small == (None, None)


def test_telemetry_export_runs_in_a_lowest_priority_worker():
    import os

    offload = Offload()
    try:
        niceness = offload.submit_background(os.nice, 0).result(timeout=60)
        pid = offload.submit_background(os.getpid).result(timeout=60)
    finally:
        offload.shutdown()
    assert niceness == 19 and pid != os.getpid()
