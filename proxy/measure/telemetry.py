"""The one boundary between a request and its telemetry.

The relay makes two calls: `start(ctx)` when the request goes upstream and `finish(ctx)` exactly
once, from the relay's one `finally`, whatever the ending. `finish` drops the in-flight gauge and
queues the request; the finisher task, one request per turn of the event loop, completes the counts
(usage, engine, tokenizer), computes the split once, and hands the context to each sink
(metrics, spans, records, request log) inside `_guard`: a failure is logged once per component,
counted in `llmproxy_telemetry_errors_total{component}`, and never reaches the client.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from types import TracebackType
from typing import Any, Protocol

import orjson

from .. import apis
from ..config import Settings
from ..wire.chunk import read_usage
from ..wire.text import MODEL_CHARS, dumps, storable
from ..wire.tokens import PromptParts, TokenCache, Tokenizer
from .context import RequestContext, record_dict
from .labels import served
from .meters import Meters
from .metrics import ProxyMetrics
from .offload import Offload
from .slo import SLOs
from .timing import Breakdown, split
from .tracing import Tracing

log = logging.getLogger("llmproxy.telemetry")
request_log = logging.getLogger("llmproxy.requests")


class Sink(Protocol):
    """One exporter of finished requests. `b` is None when the split itself failed."""

    name: str

    def export(self, ctx: RequestContext, b: Breakdown | None) -> None: ...


class Store(Protocol):
    """Where a finished request's record goes beyond memory: the records process's queue (records/outbox.py)."""

    def add(self, record: dict[str, Any]) -> None: ...


class MetricsSink:
    name = "metrics"

    def __init__(self, metrics: ProxyMetrics, upstream: str) -> None:
        self.metrics, self.upstream = metrics, upstream

    def export(self, ctx: RequestContext, b: Breakdown | None) -> None:
        upstream = ctx.upstream or self.upstream
        self.metrics.observe(ctx.timing, b, upstream, ctx.trace_id)
        if ctx.verdict is not None:
            self.metrics.observe_slo(ctx.verdict, ctx.timing.model, upstream, ctx.timing.tenant, served(ctx.timing.status_code))


class SpansSink:
    name = "tracing"

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def export(self, ctx: RequestContext, b: Breakdown | None) -> None:
        if ctx.spans is not None:  # (finish sends the SERVER and CLIENT spans whatever fails)
            self.tracing.finish(ctx.spans, ctx.timing, b, ctx.wall_offset_ns, ctx.server, ctx.verdict)


class RecordsSink:
    """The recent records in memory, the durable store (records.py) when on, and the request log."""

    name = "records"

    def __init__(self, size: int, log_requests: bool, upstream: str, instance: str) -> None:
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(1, size))
        self.log_requests = log_requests
        self.upstream, self.instance = upstream, instance
        self.store: Store | None = None  # opened by the app at start-up, in each worker (its writer: a process of its own)

    def export(self, ctx: RequestContext, b: Breakdown | None) -> None:
        if b is None:
            return
        record = record_dict(ctx, b)
        record["upstream"] = ctx.upstream or self.upstream
        record["instance"] = self.instance
        self.records.append(record)
        if self.store is not None:
            self.store.add(record)
        if self.log_requests:
            request_log.info(orjson.dumps(record).decode())


class MetersSink:
    """OTLP metrics (meters.py), when an OTLP endpoint is configured."""

    name = "otlp_metrics"

    def __init__(self, meters: Meters, upstream: str) -> None:
        self.meters, self.upstream = meters, upstream

    def export(self, ctx: RequestContext, b: Breakdown | None) -> None:
        self.meters.export(ctx.timing, b, ctx.upstream or self.upstream, ctx.server, ctx.verdict)


class Guard:
    """`with telemetry._guard(component)`: an exception in the block is counted (and logged once per
    component), never raised to the request. A class, not `@contextmanager`: a dozen per request,
    and a generator made and run for each cost 1-2 µs apiece. Stateless: one per component, shared."""

    __slots__ = ("telemetry", "component")

    def __init__(self, telemetry: Telemetry, component: str) -> None:
        self.telemetry, self.component = telemetry, component

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if kind is None or exc is None or not issubclass(kind, Exception):
            return False  # (a cancel or an exit goes on)
        self.telemetry.failed(self.component, (kind, exc, tb))
        return True


class Telemetry:
    def __init__(self, settings: Settings, metrics: ProxyMetrics, tracing: Tracing, tokenizer: Tokenizer | None, offload: Offload,
                 slos: SLOs | None = None, meters: Meters | None = None) -> None:
        self.settings = settings
        self.slos = slos or SLOs()
        self.token_cache = TokenCache()  # counts of prompt parts seen before (an agent's system prompt, tools, history)
        self.metrics = metrics
        self.tracing = tracing
        self.tokenizer = tokenizer
        self.offload = offload
        self.upstream = settings.upstream_label
        self.records_sink = RecordsSink(settings.records, settings.log_requests, self.upstream, settings.instance_name)
        self.sinks: tuple[Sink, ...] = (MetricsSink(metrics, self.upstream), SpansSink(tracing), self.records_sink,
                                        *((MetersSink(meters, self.upstream),) if meters is not None else ()))
        self._logged: set[str] = set()
        self._guards: dict[str, Guard] = {}
        self._backlog: collections.deque[RequestContext] = collections.deque()
        self._finisher: asyncio.Task[None] | None = None

    @property
    def records(self) -> collections.deque[dict[str, Any]]:
        return self.records_sink.records

    def count_error(self, component: str) -> None:
        try:
            self.metrics.telemetry_error(component)
        except Exception:  # noqa: BLE001 - the counter itself failing must not break requests
            log.exception("telemetry error counter failed")

    def _guard(self, component: str) -> Guard:
        guard = self._guards.get(component)
        if guard is None:
            guard = self._guards[component] = Guard(self, component)
        return guard

    def failed(self, component: str, exc_info: tuple[type[BaseException], BaseException, TracebackType | None]) -> None:
        self.count_error(component)
        if component not in self._logged:
            self._logged.add(component)
            log.error("telemetry component %r failed (logged once, counted always)", component, exc_info=exc_info)

    def start(self, ctx: RequestContext, headers: list[tuple[bytes, bytes]]) -> None:
        """As the request goes upstream: the in-flight gauge and the two spans whose ids must exist early."""
        t = ctx.timing
        with self._guard("metrics"):
            self.metrics.in_flight(ctx.upstream or self.upstream).inc()
            t.in_flight = True
        if self.tracing.enabled:
            with self._guard("tracing"):
                carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent", b"tracestate")}
                ctx.spans = self.tracing.start(carrier, t, t.received_ns + ctx.wall_offset_ns)
        if ctx.request is not None and self.settings.capture_content:
            with self._guard("tracing"):
                body = ctx.request
                t.captured_input = dumps(body.get("messages") or body.get("prompt") or body.get("input")).decode("utf-8", "replace")

    def ejected(self, upstream: str, reason: str, seconds: float) -> None:
        """A replica set aside for failing (health.py): counted, and said (rare, and an operator's first question)."""
        log.warning("replica %s set aside for %.0f s: %s", upstream, seconds, reason.replace("_", " "))
        with self._guard("metrics"):
            self.metrics.child("llmproxy_upstream_ejections", upstream, reason).inc()

    def moved(self, ctx: RequestContext, upstream: str) -> None:
        """The request failed over to another replica: its in-flight count goes with it."""
        with self._guard("metrics"):
            if ctx.timing.in_flight:
                self.metrics.in_flight(ctx.upstream or self.upstream).dec()
                self.metrics.in_flight(upstream).inc()

    def finish(self, ctx: RequestContext) -> None:
        """Exactly once per request, from the relay's `finally`, after its last byte. The gauge drops
        now; the rest (counts, split, sinks) is queued for the finisher task.

        Why queued: requests that ended together (streams on one schedule, a burst) would otherwise
        each run their whole finish before any other stream's next chunk or new request is looked
        at; the finisher does one request per turn of the event loop, so ready I/O goes between.
        """
        if ctx.finished:
            return
        ctx.finished = True
        t = ctx.timing
        if t.in_flight:
            t.in_flight = False
            with self._guard("metrics"):
                self.metrics.in_flight(ctx.upstream or self.upstream).dec()
        self._backlog.append(ctx)
        if self._finisher is None or self._finisher.done():
            self._finisher = asyncio.get_running_loop().create_task(self._drain_backlog())

    @property
    def idle(self) -> bool:
        """No finished request is waiting to be exported."""
        return not self._backlog and (self._finisher is None or self._finisher.done())

    async def drain(self) -> None:
        """Until every finished request is exported (the server's shutdown, tests)."""
        while self._finisher is not None and not self._finisher.done():
            await asyncio.shield(self._finisher)

    async def _drain_backlog(self) -> None:
        backlog = self._backlog
        while backlog:
            await asyncio.sleep(0)  # ready I/O first
            # One request per turn while the backlog is short; a growing one (requests ending
            # faster than one per turn) drains by a quarter per turn, so it stays bounded.
            for _ in range(1 + len(backlog) // 4):
                if not backlog:
                    break
                await self._complete(backlog.popleft())

    async def _complete(self, ctx: RequestContext) -> None:
        t = ctx.timing
        try:
            with self._guard("timing"):  # whatever fails, the sinks below still run
                self._counts(ctx)
            try:
                await self._count_tokens(ctx)  # guards its own errors: only a shutdown cancel gets out
            finally:
                self._export(ctx)  # cancelled mid-count too: export what is known
        finally:
            ctx.request = None
            t.chunk_text.clear()  # generated text never outlives the request
            t.captured_input = t.captured_output = ""

    def _counts(self, ctx: RequestContext) -> None:
        t, usage, body = ctx.timing, ctx.usage, ctx.body
        if body is not None:
            usage = usage or body.usage
            t.response_model = t.response_model or body.model
        t.response_model = storable(t.response_model, MODEL_CHARS)  # (the upstream's string: into every sink)
        counts = read_usage(usage)
        t.prompt_tokens, t.completion_tokens = counts.prompt, counts.completion
        t.cached_prompt_tokens, t.reasoning_tokens = counts.cached_prompt, counts.reasoning
        t.token_source = "usage" if usage else "tokenizer"
        engine = t.engine
        if engine is not None:
            if not usage and engine.prompt_tokens is not None and engine.predicted_tokens is not None:
                t.prompt_tokens, t.completion_tokens, t.token_source = engine.prompt_tokens, engine.predicted_tokens, "engine"
            if t.cached_prompt_tokens is None and engine.cached_tokens is not None:
                t.cached_prompt_tokens = engine.cached_tokens
                if engine.source == "llama.cpp" and engine.prompt_tokens is not None and t.token_source == "engine":
                    t.prompt_tokens = engine.prompt_tokens + engine.cached_tokens  # llama.cpp's prompt_n is the uncached part

    def _export(self, ctx: RequestContext) -> None:
        t = ctx.timing
        b: Breakdown | None = None
        with self._guard("timing"):
            b = split(t)
        if ctx.lesson is not None:
            with self._guard("timing"):
                ctx.lesson.finished(t, b)
        if b is not None:
            with self._guard("slo"):
                ctx.verdict = self.slos.judge(t, b)
        if b is not None and self.settings.capture_content:
            t.captured_output = "".join(t.chunk_text) or (ctx.body.text if ctx.body else "")
        for sink in self.sinks:
            with self._guard(sink.name):
                sink.export(ctx, b)

    async def _prompt_count(self, parts: PromptParts) -> tuple[int, float, int]:
        """(tokens, seconds, tokens looked up): only the parts the cache does not know are counted;
        the others' time is their tokens at the tokenizer rate this process measured (TokenCache)."""
        tokenizer, cache = self.tokenizer, self.token_cache
        assert tokenizer is not None
        encoding = tokenizer.encoding_name(parts.model)
        hits_before, misses_before = cache.hits, cache.misses
        known = cache.lookup(encoding, parts.texts)
        missing = [text for text, count in zip(parts.texts, known) if count is None]
        looked_up = sum(count for count in known if count is not None)
        seconds = 0.0
        counts: list[int] = []
        if missing:
            counts, seconds = await self.offload.counts(tokenizer, parts.model, missing)
            cache.store(encoding, missing, counts)
            cache.measured(sum(counts), seconds)
        with self._guard("metrics"):
            self.metrics.token_cache(cache.hits - hits_before, cache.misses - misses_before, cache.bytes)
        return parts.fixed + looked_up + sum(counts), seconds + looked_up * cache.seconds_per_token, looked_up

    async def _count_tokens(self, ctx: RequestContext) -> None:
        """Prompt tokens (always timed: the tokenize phase), then completion tokens per chunk if needed.

        This runs after the response was relayed, so tokenization never delays a request; the
        tokenize phase is the tokenizer's CPU time, which stands for the server's own tokenization.
        """
        t = ctx.timing
        if self.tokenizer is None:
            return
        parts = ctx.prompt_parts
        if parts is None and ctx.request is not None:
            with self._guard("tokenizer"):
                parts = apis.BY_NAME[t.api].prompt_parts(t.endpoint, ctx.request)
        if parts is not None:
            with self._guard("tokenizer"):
                count, seconds, looked_up = await self._prompt_count(parts)
                t.tokenize_prompt_s, t.prompt_uncounted_parts, t.tokenize_looked_up_tokens = seconds, parts.uncounted, looked_up
                if t.prompt_tokens is None:
                    t.prompt_tokens = count
        text = ctx.body.text if ctx.body is not None else ""
        texts = t.chunk_text if t.chunk_text else ([text] if text else [])
        hidden_unknown = t.hidden_reasoning_blocks and t.reasoning_tokens is None and t.completion_tokens is not None
        visible = t.visible_tokens
        if not texts or (not hidden_unknown and visible is not None and (visible == len(t.content_ns) or not t.content_ns)):
            return  # counts known, and one token per chunk (or no chunks to divide): nothing to count
        with self._guard("tokenizer"):
            counts, seconds = await self.offload.thread(sum(map(len, texts)), self.tokenizer.timed_chunk_counts, t.model, texts)
            t.tokenize_completion_s = seconds
            total = sum(counts)
            if hidden_unknown and t.completion_tokens is not None:  # never streamed, never reported apart: the rest is hidden
                t.reasoning_tokens = max(0, t.completion_tokens - total)
                visible = t.visible_tokens
            if t.content_ns:
                scale = visible / total if visible is not None and total else 1.0
                t.chunk_tokens = [count * scale for count in counts]  # usage's total, shared by the tokenizer's counts
            if t.completion_tokens is None:
                t.completion_tokens = total
