"""The one boundary between a request and its telemetry.

`start` and `finish` are the only calls the relay makes. Each telemetry component (tokenizer,
metrics, tracing, records, log) runs inside `_guard`: a failure is logged once per component,
counted in `llmproxy_telemetry_errors_total{component}`, and never reaches the client.
`finish` runs exactly once per request, after the last byte was relayed.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import Any, Iterator

import orjson

from .chunk import read_usage
from .config import Settings
from .metrics import ProxyMetrics
from .timing import Breakdown, RequestTiming, split
from .tokens import Tokenizer
from .tracing import RequestSpans, Tracing

log = logging.getLogger("llmproxy.telemetry")
INLINE_TOKENIZE_BYTES = 16 * 1024  # about 4,000 tokens: well under a millisecond to count
request_log = logging.getLogger("llmproxy.requests")


def record_dict(t: RequestTiming, b: Breakdown) -> dict[str, Any]:
    """The stored per-request record: timings and counts, never text or credentials."""
    return {
        "endpoint": t.endpoint,
        "model": t.model,
        "response_model": t.response_model,
        "stream": t.stream,
        "status_code": t.status_code,
        "outcome": t.outcome,
        "error": t.error,
        "duration_s": b.e2e_s,
        "ttft_s": b.ttft_s,
        "decode_s": b.decode_s,
        "decode_tokens_per_second": b.decode_tokens_per_second,
        "prefill_tokens_per_second": b.prefill_tokens_per_second,
        "phases_s": b.phases,
        "proxy_before_after_s": [b.proxy_before_s, b.proxy_after_s],
        "dominant_phase": b.dominant,
        "connect_s": b.connect,
        "pool_wait_s": b.pool_wait_s,
        "rtt_s": t.rtt_s,
        "reused_connection": t.reused,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "token_source": t.token_source,
        "tokenize_prompt_s": t.tokenize_prompt_s,
        "content_chunks": len(t.content_ns),
        "malformed_chunks": t.malformed_chunks,
        "inter_token_p50_s": _median(b.inter_token_s),
        "engine": t.engine.as_dict() if t.engine is not None else None,
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class Telemetry:
    def __init__(self, settings: Settings, metrics: ProxyMetrics, tracing: Tracing, tokenizer: Tokenizer | None, executor: Executor) -> None:
        self.settings = settings
        self.metrics = metrics
        self.tracing = tracing
        self.tokenizer = tokenizer
        self.executor = executor
        self.upstream = settings.upstream_label
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(1, settings.records))
        self.in_flight = metrics.in_flight(self.upstream)
        self._logged: set[str] = set()
        self._pending: dict[int, tuple[dict[str, Any], int]] = {}  # request body and size, to tokenize at finish

    def count_error(self, component: str) -> None:
        try:
            self.metrics.telemetry_error(component)
        except Exception:  # noqa: BLE001 - the counter itself failing must not break requests
            log.exception("telemetry error counter failed")

    @contextmanager
    def _guard(self, component: str) -> Iterator[None]:
        try:
            yield
        except Exception:
            self.count_error(component)
            if component not in self._logged:
                self._logged.add(component)
                log.exception("telemetry component %r failed (logged once, counted always)", component)

    def start(self, t: RequestTiming, headers: list[tuple[bytes, bytes]], body: dict[str, Any] | None, wall_offset: int,
              size: int = 0) -> RequestSpans | None:
        """At request start: the in-flight gauge and the two early spans. Tokenization waits for finish."""
        spans = None
        with self._guard("metrics"):
            self.in_flight.inc()
            t.in_flight = True
        if self.tracing.enabled:
            with self._guard("tracing"):
                carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent", b"tracestate")}
                spans = self.tracing.start(carrier, t, t.received_ns + wall_offset)
        if body is not None and self.settings.capture_content:
            with self._guard("tracing"):
                t.captured_input = orjson.dumps(body.get("messages") or body.get("prompt") or body.get("input")).decode()
        if body is not None and self.tokenizer is not None and t.endpoint != "other":
            self._pending[id(t)] = (body, size)
        return spans

    async def finish(
        self,
        t: RequestTiming,
        spans: RequestSpans | None,
        wall_offset: int,
        usage: dict[str, Any] | None = None,
        body: Any = None,
    ) -> None:
        if t.finalized:
            return
        t.finalized = True
        if t.in_flight:
            with self._guard("metrics"):
                self.in_flight.dec()
        text = ""
        if body is not None:  # a non-streaming JSON response (relay.BodyInfo)
            usage, text = usage or body.usage, body.text
            t.response_model = t.response_model or body.model
        t.prompt_tokens, t.completion_tokens = read_usage(usage)
        t.token_source = "usage" if usage else "tokenizer"
        engine = t.engine
        if not usage and engine is not None and engine.prompt_tokens is not None and engine.predicted_tokens is not None:
            t.prompt_tokens, t.completion_tokens, t.token_source = engine.prompt_tokens, engine.predicted_tokens, "engine"
        await self._count_tokens(t, text)
        try:
            b = split(t)
        except Exception:
            self.count_error("timing")
            log.exception("could not compute the phase split")
            return
        if self.settings.capture_content:
            t.captured_output = "".join(t.chunk_text) or text
        trace_id = spans.trace_id if spans is not None else None
        with self._guard("metrics"):
            self.metrics.observe(t, b, self.upstream, trace_id)
        if spans is not None:
            await asyncio.sleep(0)  # let other streams' chunks through between the heavier steps
            with self._guard("tracing"):
                self.tracing.finish(spans, t, b, wall_offset)
        with self._guard("records"):
            record = record_dict(t, b)
            if trace_id:
                record["trace_id"] = trace_id
            self.records.append(record)
            if self.settings.log_requests:
                request_log.info(orjson.dumps(record).decode())
        t.chunk_text.clear()  # generated text never outlives the request
        t.captured_input = t.captured_output = ""

    async def _off_loop(self, size: int, fn: Any, *args: Any) -> Any:
        """Small inputs run inline (cheaper than a thread hop); large ones in the pool, so a long
        tokenization never stalls other streams on the event loop."""
        if size <= INLINE_TOKENIZE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _count_tokens(self, t: RequestTiming, text: str) -> None:
        """Prompt tokens (always timed: the tokenize phase), then completion tokens if needed.

        This runs after the response was relayed, so tokenization never delays a request; the
        tokenize phase is the measured duration, which the server pays before its prefill.
        """
        pending = self._pending.pop(id(t), None)
        if self.tokenizer is None:
            return
        if pending is not None:
            body, size = pending
            with self._guard("tokenizer"):
                count, seconds = await self._off_loop(size, self.tokenizer.timed_prompt_count, t.endpoint, body)
                t.tokenize_prompt_s = seconds
                if t.prompt_tokens is None:
                    t.prompt_tokens = count
        texts = t.chunk_text if t.chunk_text else ([text] if text else [])
        known = t.completion_tokens
        if not texts or (known is not None and (known == len(t.content_ns) or not t.content_ns)):
            return  # counts known, and one token per chunk (or no chunks to divide): nothing to count
        with self._guard("tokenizer"):
            size = sum(map(len, texts))
            counts, seconds = await self._off_loop(size, self.tokenizer.timed_chunk_counts, t.model, texts)
            t.tokenize_completion_s = seconds
            if t.content_ns:
                t.chunk_tokens = counts
            if known is None:
                t.completion_tokens = sum(counts)
